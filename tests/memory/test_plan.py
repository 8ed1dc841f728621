"""The planner (memory/plan.py, Note [how plans are ranked]): the cheapest configuration
that fits, the batch kept and its accumulators counted, optimizer states on disk when the
host is the limit, experts split when that is what fits."""

import pytest
import torch

from fullshard.cli.memory import plan_main
from fullshard.gpt import GPT, GPTConfig
from fullshard.memory import estimate, plan


# blocks of 3.1M parameters: above the 2**20 merging threshold, so each is its own unit
SMALL = GPTConfig(vocab_size=1000, seq_len=256, d_model=512, n_layers=4, n_heads=8)


@pytest.mark.slow
def test_plan_takes_the_cheapest_configuration_that_fits(capsys):
    kwargs = dict(world_size=4, batch_size=4, seq_len=256, device="cpu", process_baseline=0)
    by_strategy = {s: estimate(SMALL, strategy=s, **kwargs).total
                   for s in ("no_shard", "shard_grad_op", "full_shard")}
    budget = int(by_strategy["full_shard"] * 1.1) + 1
    assert budget < by_strategy["no_shard"] * 1.1
    chosen = plan(SMALL, budget_bytes=budget, margin=0.1, **kwargs)
    assert chosen.choice is not None and chosen.estimate.total * 1.1 <= budget
    assert chosen.choice.cost >= 1.0 and chosen.rejected  # something cheaper did not fit
    assert all(c.cost <= chosen.choice.cost for c, _ in chosen.rejected)
    assert plan(SMALL, budget_bytes=1, **kwargs).choice is None
    assert plan_main(["--preset", "debug", "--world-size", "2", "--budget-gib", "1"]) == 0
    assert "fullshard train --preset debug --parallel.strategy" in capsys.readouterr().out


def test_plan_keeps_the_batch_and_counts_what_accumulation_keeps():
    # Note [how plans are ranked]: micro-batches divide the batch, and one below it keeps
    # every unsharded gradient (fp32) until the last micro-batch reduces
    from fullshard.memory.plan import candidates
    from fullshard.memory.plan_search import with_accumulators as _with_accumulators
    assert {c.micro_batch for c in candidates(6, False)} == {6, 3, 1}
    assert {c.micro_batch for c in candidates(5, False)} == {5, 1}
    assert all(c.micro_batch * c.grad_accum == 5 for c in candidates(5, False))
    est = estimate(SMALL, world_size=2, batch_size=1, seq_len=256, device="cpu",
                   process_baseline=0)
    whole, split = (next(c for c in candidates(4, False)
                         if c.strategy == "full_shard" and c.micro_batch == mb)
                    for mb in (4, 1))
    assert _with_accumulators(est, whole) is est
    grown = _with_accumulators(est, split)
    assert grown.total - est.total == 4 * est.trainable_params


LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": False}


@pytest.mark.slow
@pytest.mark.extended
def test_plan_puts_optimizer_states_on_disk_when_the_host_is_the_limit(tmp_path):
    """Llama 3 8B full fine-tune on two 24 GB GPUs with 40 GiB of host memory per rank:
    CPU offload fits the GPUs but not its host side (fp32 shards, gradients and AdamW
    states of 4.0B elements per rank); given a states directory the plan moves the AdamW
    states to disk and prints the flag that does it."""
    from fullshard.memory import plan
    gib = 2 ** 30
    kwargs = dict(world_size=2, budget_bytes=24 * gib, batch_size=1, seq_len=2048,
                  mp_policy=torch.bfloat16, allow_offload=True, host_budget_bytes=40 * gib)
    without = plan(LLAMA_8B, **kwargs)
    assert without.choice is None
    assert any(nbytes < 0 for _, nbytes in without.rejected)  # ruled out by the host
    chosen = plan(LLAMA_8B, offload_dir=str(tmp_path), **kwargs)
    assert chosen.choice is not None and chosen.choice.states_on_disk, chosen.explain()
    est = chosen.estimate
    cpu = estimate(LLAMA_8B, world_size=2, strategy=chosen.choice.strategy, batch_size=1,
                   seq_len=2048, mp_policy=torch.bfloat16, offload="cpu",
                   activation_checkpointing=chosen.choice.activation_checkpointing)
    per_rank = 8_030_261_248 // 2
    assert est.disk_bytes == pytest.approx(8 * per_rank, rel=0.01)  # AdamW: 2 x fp32
    staging = 3 * 2 * (4 * 2 ** 20 * 4 + 4096)  # three chunks of 4M elements, two fp32
    # states each, each buffer 4 KiB over for its alignment; the files pad each unit's
    # states to a 4,096-element start, under 32 KiB per unit
    assert est.host_bytes == pytest.approx(cpu.host_bytes - est.disk_bytes + staging,
                                           abs=32 * 2 ** 10 * 40)
    assert est.total == cpu.total  # the device side is CPU offload's
    assert f"--parallel.offload disk:{tmp_path}" in chosen.train_flags("bf16")
    table = est.table()
    assert "offload (states on disk)" in table and "disk for optimizer states" in table
    # with 24 GiB of host, states on disk still leave the fp32 shards and gradients (about
    # 30 GiB, 35 GiB in the pinned allocator's power-of-two blocks): parameters go to disk
    # as well, and the flags say so
    chosen = plan(LLAMA_8B, offload_dir=str(tmp_path), **{**kwargs, "host_budget_bytes": 24 * gib})
    assert chosen.choice is not None and chosen.choice.params_on_disk, chosen.explain()
    est = chosen.estimate
    assert est.host_bytes * 1.1 <= 24 * gib
    assert est.disk_bytes == pytest.approx(12 * per_rank, rel=0.01)  # states and fp32 shards
    flags = chosen.train_flags("bf16")
    assert f"--parallel.offload disk:{tmp_path} --parallel.offload_params true" in flags
    assert "states and parameters on disk" in est.table()


def test_plan_splits_grouped_experts_when_that_is_what_fits():
    """A budget between the estimates with and without expert parallelism: the plan
    splits the experts (not charged) before it recomputes or offloads, the smallest
    degree that fits first, and its flags carry --parallel.ep; a dense model and a
    ModuleList of experts get no such candidate."""
    from fullshard.memory.plan import expert_degrees
    moe = dict(vocab_size=65, seq_len=64, d_model=512, n_layers=4, n_heads=4, mlp_ratio=4,
               n_experts=8, top_k=2)
    cfg = GPTConfig(**moe, grouped_experts=True)
    whole, half, quarter = (estimate(cfg, world_size=4, ep=ep, batch_size=2,
                                     strategy="shard_grad_op").total for ep in (1, 2, 4))
    assert whole > half > quarter
    budget = int((half + whole) / 2 * 1.1)  # the margin: half fits, whole does not
    chosen = plan(cfg, world_size=4, budget_bytes=budget, batch_size=2)
    assert (chosen.choice.strategy, chosen.choice.ep) == ("shard_grad_op", 2)
    assert not chosen.choice.activation_checkpointing and not chosen.choice.offload
    assert chosen.train_flags().endswith("--parallel.ep 2")
    assert "experts split over 2 ranks" in chosen.explain()
    with torch.device("meta"):
        assert expert_degrees(GPT(cfg), 4) == (1, 2, 4)
        assert expert_degrees(GPT(cfg), 6) == (1, 2)
        assert expert_degrees(GPT(GPTConfig(**moe)), 4) == (1,)
        assert expert_degrees(GPT(GPTConfig(vocab_size=65, d_model=64, n_heads=4)), 4) == (1,)


def test_plan_prints_a_muon_command_the_trainer_accepts(capsys):
    from fullshard.cli.train import build_parser, resolve_config

    assert plan_main(["--preset", "debug", "--optimizer", "muon", "--world-size", "2",
                      "--budget-gib", "1"]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert command.startswith("fullshard train ") and "--optim.name muon" in command
    cfg, _ = resolve_config(build_parser().parse_args(command.split()[2:]))
    assert cfg.optim.name == "muon"


@pytest.mark.parametrize("argv", [
    ["estimate", "--preset", "moe", "--optimizer", "muon", "--world-size", "2"],
    ["plan", "--preset", "moe", "--optimizer", "muon", "--world-size", "2", "--budget-gib", "1"],
    ["estimate", "--preset", "debug", "--optimizer", "muon", "--offload", "disk", "--world-size",
     "2"],
    ["plan", "--preset", "debug", "--optimizer", "muon", "--world-size", "2", "--budget-gib", "1",
     "--allow-offload", "--offload-dir", "."],
])
def test_estimate_and_plan_refuse_muon_where_the_trainer_does(argv, capsys):
    from fullshard.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fullshard {argv[0]}: --optimizer: muon steps ") and "\n" not in err
