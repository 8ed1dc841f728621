"""The memory estimator without training (memory/estimate.py): the breakdown adds up and
allocates nothing, strategies order the peaks, Hugging Face configs, int8 communication,
Muon's states and expert parallelism."""

import pytest
import torch

from fullshard.memory import estimate, plan
from fullshard.memory.process import current_rss_bytes
from fullshard.memory.units import find_units, layout_groups
from fullshard.gpt import GPT, GPTConfig, GroupedExperts

# blocks of 3.1M parameters: above the 2**20 merging threshold, so each is its own unit
SMALL = GPTConfig(vocab_size=1000, seq_len=256, d_model=512, n_layers=4, n_heads=8)


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
