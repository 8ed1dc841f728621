"""The memory estimator without training: ZeRO's Table 1, the breakdown, the trace, the CLI."""

import pytest
import torch

from fullshard.memory import estimate, plan, zero_model_state_bytes
from fullshard.memory.activations import trace_step
from fullshard.cli.memory import estimate_main, plan_main
from fullshard.memory.process import current_rss_bytes
from fullshard.memory.units import find_units, layout_groups
from fullshard.gpt import GPT, GPTConfig, GroupedExperts, lm_loss

# blocks of 3.1M parameters: above the 2**20 merging threshold, so each is its own unit
SMALL = GPTConfig(vocab_size=1000, seq_len=256, d_model=512, n_layers=4, n_heads=8)


@pytest.mark.parametrize("params, world, expected", [
    (7.5e9, 64, {1: 31.4, 2: 16.6, 3: 1.88}),
    (128e9, 64, {1: 536, 2: 284, 3: 32}),
    (1e12, 1024, {1: 4011, 2: 2013, 3: 15.6}),
])
def test_zero_paper_table_1(params, world, expected):
    for stage, gb in expected.items():
        got = zero_model_state_bytes(params, world, stage) / 1e9
        # the paper prints 3 significant digits and truncates 2013.67 and 4011.72
        assert abs(got - gb) < max(0.01 * gb, 0.7) + 1e-9 and got >= gb - 0.05, (stage, got)


def test_estimate_allocates_nothing_and_its_lines_add_up():
    # a first estimate loads what torch imports lazily on first use (with triton installed,
    # as with every CUDA build of torch, that alone is over 100 MiB)
    estimate(GPTConfig(), world_size=2, batch_size=1, seq_len=8)
    cfg = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12)
    before = current_rss_bytes()
    est = estimate(cfg, world_size=8, batch_size=8, seq_len=1024, mp_policy=torch.bfloat16)
    assert current_rss_bytes() - before < 64 * 2**20  # a 124M model at batch 8 would be GBs
    assert est.total == sum(est.lines.values())
    params = cfg.num_params()
    assert est.num_params == params
    # fp32 shards (padded rows are at most one row per parameter per rank)
    assert 4 * params / 8 <= est.lines["sharded parameters"] < 4 * params / 8 * 1.01
    assert est.lines["optimizer states"] >= 2 * est.lines["sharded parameters"] * 0.99
    assert est.phase_peaks[est.peak_phase] == est.total


@pytest.mark.slow
def test_strategies_checkpointing_and_world_size_order_the_peaks():
    def total(**kw):
        return estimate(SMALL, batch_size=4, seq_len=256, **kw).total

    assert total(world_size=4) < total(world_size=4, strategy="shard_grad_op") \
        < total(world_size=4, strategy="no_shard")
    assert total(world_size=4) < total(world_size=2) < total(world_size=1)
    assert total(world_size=4, activation_checkpointing=True) < total(world_size=4)
    assert total(world_size=4, offload=True) < total(world_size=4)


def test_trace_keeps_what_fused_attention_keeps():
    """Not the seq x seq attention matrix of SDPA's math path (meta's default)."""
    cfg = GPTConfig(vocab_size=64, seq_len=2048, d_model=64, n_layers=2, n_heads=4)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    trace = trace_step(model, find_units(model), lambda m: lm_loss(m(tokens), tokens))
    attention_matrix = 4 * 2048 * 2048 * 4  # heads x seq x seq fp32, one layer
    assert 0 < trace.saved_at_forward_end < attention_matrix
    kinds = [e.kind for e in trace.events]
    assert kinds.count("pre_backward") == 3 and kinds[-1] == "backward_end"


def test_hugging_face_config(tmp_path):
    pytest.importorskip("transformers")
    import json

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 500, "max_position_embeddings": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    est = estimate(str(path), world_size=2, batch_size=2, seq_len=64)
    assert est.lines["activations"] > 0 and est.num_params > 0
    assert "llama" in est.settings["model"]


def test_cli_estimate_sweep_and_zero_table(capsys):
    assert estimate_main(["--preset", "debug", "--world-size", "2", "--batch", "2"]) == 0
    assert "peak per rank" in capsys.readouterr().out
    assert estimate_main(["--preset", "debug", "--world-size", "4", "--sweep"]) == 0
    out = capsys.readouterr().out
    assert "no_shard" in out and len(out.strip().splitlines()) == 5  # title, head, 1 2 4
    assert estimate_main(["--zero-table", "--params", "7.5e9", "--world-size", "64"]) == 0
    assert "31.406" in capsys.readouterr().out


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
    from fullshard.memory.plan import _with_accumulators, candidates
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


def test_tune_cpu_allocator_refuses_a_threshold_that_is_not_a_positive_int():
    from fullshard.memory import tune_cpu_allocator

    for bad in (0, -1, 4.0, "4MiB"):
        with pytest.raises(ValueError, match=r"tune_cpu_allocator: mmap_threshold_bytes must "
                                             r"be a positive int"):
            tune_cpu_allocator(bad)


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
    staging = 3 * 4 * 2 ** 20 * 8  # three chunks of 4M elements, two fp32 states each
    assert est.host_bytes == cpu.host_bytes - est.disk_bytes + staging
    assert est.total == cpu.total  # the device side is CPU offload's
    assert f"--parallel.offload disk:{tmp_path}" in chosen.train_flags("bf16")
    table = est.table()
    assert "offload (states on disk)" in table and "disk for optimizer states" in table
    # with 20 GiB of host, states on disk still leave the fp32 shards and gradients (about
    # 30 GiB): parameters go to disk as well, and the flags say so
    chosen = plan(LLAMA_8B, offload_dir=str(tmp_path), **{**kwargs, "host_budget_bytes": 20 * gib})
    assert chosen.choice is not None and chosen.choice.params_on_disk, chosen.explain()
    est = chosen.estimate
    assert est.host_bytes * 1.1 <= 20 * gib
    assert est.disk_bytes == pytest.approx(12 * per_rank, rel=0.01)  # states and fp32 shards
    flags = chosen.train_flags("bf16")
    assert f"--parallel.offload disk:{tmp_path} --parallel.offload_params true" in flags
    assert "states and parameters on disk" in est.table()


@pytest.mark.slow
def test_estimate_and_plan_with_int8_communication():
    """int8 reduce-scatters replace gloo's full-size receive buffer by int8 ones (lower);
    no_shard has nothing to quantize (refused by estimate, skipped by plan); the plan's
    flags carry --parallel.quantize."""
    cfg = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8)
    kw = dict(world_size=2, batch_size=8, device="cpu", process_baseline=0)
    plain, int8 = estimate(cfg, **kw), estimate(cfg, quantize_comm="weights,grads", **kw)
    assert int8.lines["communication buffers"] < plain.lines["communication buffers"]
    assert int8.settings["quantize_comm"] == "weights,grads"
    with pytest.raises(ValueError, match="no_shard does not issue"):
        estimate(cfg, strategy="no_shard", quantize_comm="grads", **kw)
    chosen = plan(cfg, world_size=2, budget_bytes=2 ** 40, batch_size=8, device="cpu",
                  process_baseline=0, quantize_comm="grads")
    assert chosen.choice.strategy != "no_shard"
    assert "--parallel.quantize grads" in chosen.train_flags()


def test_muon_estimate_keeps_adamw_states_where_the_recipe_uses_adamw():
    """optimizer="muon" is the trainer's recipe: the hidden matrices hold Muon's momentum
    and whole copies with their owners (Note [whole-matrix optimizers]), the embeddings,
    head and norms AdamW's two states."""
    cfg = GPTConfig(vocab_size=4096, seq_len=64, d_model=128, n_layers=2, n_heads=2)
    with torch.device("meta"):
        model = GPT(cfg)
    hidden = sum(p.numel() for n, p in model.named_parameters()
                 if p.dim() == 2 and "emb" not in n and "head" not in n)
    everything = sum(p.numel() for p in model.parameters())
    adamw, muon = (estimate(cfg, world_size=1, batch_size=1, optimizer=o, device="cpu",
                            process_baseline=0).lines["optimizer states"]
                   for o in ("adamw", "muon"))
    assert adamw == 2 * 4 * everything
    # AdamW's 2 on the rest; on the matrices: rows as written, then momentum and whole
    # copy on the one rank that owns them all
    assert muon == 4 * (2 * (everything - hidden) + hidden + 2 * hidden)


def test_expert_parallelism_makes_each_blocks_experts_a_unit_holding_its_part():
    """ep=2 over 4 ranks: each block's grouped experts are a group of their own holding 4 of
    the 8 experts, sharded over 2 ranks, never merged; the blocks keep the rest, over 4."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2,
                    mlp_ratio=2, n_experts=8, top_k=2, grouped_experts=True)
    with torch.device("meta"):
        model = GPT(cfg)
    units = find_units(model, split_experts=True)
    groups = layout_groups(units, 4, True, bucket_numel=10 ** 9, ep=2)  # merge all that may
    experts = [g for g in groups if g.name == "GroupedExperts"]
    per_expert = 2 * (32 * 64) + 64 + 32  # fc and proj weights, their biases
    assert len(experts) == 2 and all(len(g.units) == 1 for g in experts)
    for g in experts:
        assert g.shard_size == 2 and g.unsharded_numel == 4 * per_expert
        assert g.shard_numel == 2 * per_expert
    others = [g for g in groups if g.name != "GroupedExperts"]
    assert all(g.shard_size == 4 for g in others)
    dense = sum(p.numel() for p in model.parameters()) - 2 * 8 * per_expert
    assert sum(p.numel for g in others for p in g.params) == dense
    assert all(isinstance(units[g.units[0]], GroupedExperts) for g in experts)


@pytest.mark.parametrize("kwargs, message", [
    ({"ep": 3}, "ep=3 must divide world_size 4"),
    ({"ep": 2, "strategy": "no_shard"}, "with strategy full_shard or shard_grad_op"),
    ({"ep": 2, "model": "debug"}, "GPT d=32 L=2 has none"),
])
def test_expert_parallel_estimates_refuse_what_does_not_fit(kwargs, message):
    model = kwargs.pop("model", "moe")
    with pytest.raises(ValueError, match=message):
        estimate(model, world_size=4, **kwargs)


def test_estimate_cli_takes_the_expert_parallel_degree(capsys):
    peaks = {}
    for ep in ("1", "4"):
        assert estimate_main(["--preset", "moe", "--world-size", "4", "--ep", ep,
                              "--batch", "1"]) == 0
        text = capsys.readouterr().out
        peaks[ep] = float(text.split("peak per rank")[1].split("MiB")[0].split()[-1])
        assert ("experts split over 4 ranks" in text) == (ep == "4")
    # ep 4 over 4 ranks: a rank's experts are whole on it, nothing of them gathered
    assert peaks["4"] < peaks["1"]


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
