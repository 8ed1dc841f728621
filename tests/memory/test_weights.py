"""The estimate and the plan with quantized weights and LoRA adapters (Note [quantized
weights in the estimate] in memory/weights.py): the bytes each format costs, the
estimate against a real QLoRA run's peak, and the case QLoRA users plan for: a 70B
Llama on two 24 GB GPUs."""

import pytest
import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.cli import main as fullshard_main
from fullshard.memory import MemoryTracker, estimate, plan, tune_cpu_allocator
from fullshard.memory.allocator import release_free_heap
from fullshard.memory.weights import FLOAT8_BYTES, NF4_BYTES
from fullshard.testing import run_distributed
from fullshard.gpt import PRESET_SHAPES, GPT
from fullshard.testing.memory import tracked_token_steps

MIB, GIB = 2 ** 20, 2 ** 30
# Llama 3 70B's shape (its published config.json, the fields the model is built from).
LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "tie_word_embeddings": False}


def _block_linear_numel(preset: str) -> tuple[int, int]:
    """(elements in the blocks' linear weights, elements in every other parameter)."""
    with torch.device("meta"):
        model = GPT(PRESET_SHAPES[preset])
    linear = sum(m.weight.numel() for layer in model.layers for m in layer.modules()
                 if type(m) is torch.nn.Linear)
    return linear, sum(p.numel() for p in model.parameters()) - linear


@pytest.mark.parametrize("quantize, lora_rank", [("nf4", 8), ("float8", 0), (None, 8)])
def test_each_format_costs_its_bytes(quantize, lora_rank):
    """Sharded bytes at world size 1 (no padding): NF4 weights at 0.516 bytes each, float8
    and LoRA-frozen weights at the parameter dtype's; gradients and optimizer states for
    what trains only; the float8 gather moves one byte per weight."""
    linear, other = _block_linear_numel("gpt2-124m")
    kw = dict(world_size=1, batch_size=1, seq_len=64)
    plain = estimate("gpt2-124m", **kw)
    est = estimate("gpt2-124m", quantize=quantize, lora_rank=lora_rank, **kw)
    adapters = est.num_params - plain.num_params
    shard = est.lines["sharded parameters"]
    if quantize == "nf4":
        assert shard == pytest.approx(linear * NF4_BYTES + (other + adapters) * 4, abs=1024)
    else:
        assert shard == (linear + other + adapters) * 4
    trainable = linear + other if quantize == "float8" else adapters
    assert est.trainable_params == trainable
    # AdamW's two states, plus the foreach temporaries when the peak is in the step
    assert 2 * 4 * trainable <= est.lines["optimizer states"] <= 3 * 4 * trainable
    if lora_rank:
        assert est.total < 0.6 * plain.total
    if quantize is not None:  # the blocks gather their weights beside the flat buffers
        _check_gather_layout(quantize, lora_rank)


def _check_gather_layout(quantize: str, lora_rank: int) -> None:
    from fullshard.memory.units import find_units, layout_groups
    from fullshard.memory.weights import adapt_weights

    with torch.device("meta"):
        model = GPT(PRESET_SHAPES["gpt2-124m"])
    units = find_units(model)
    linears = [[m.weight for m in layer.modules() if type(m) is torch.nn.Linear]
               for layer in model.layers]
    subclass = adapt_weights(model, units, quantize, lora_rank)
    groups = layout_groups(units, 4, True, 10 ** 9, subclass)  # a bucket size that merges
    per_byte = NF4_BYTES if quantize == "nf4" else FLOAT8_BYTES
    blocks = [g for g in groups if not g.is_root]
    assert len(blocks) == len(model.layers)  # never merged into buckets
    for g, layer, linear in zip(blocks, model.layers, linears):
        assert {p.key for p in g.subclass} == {id(w) for w in linear}
        assert g.subclass_send_bytes == pytest.approx(
            sum(w.numel() for w in linear) / 4 * per_byte, abs=1)
        assert g.shard_numel * 4 == sum(p.numel() for p in layer.parameters()) - sum(
            w.numel() for w in linear)


def test_bad_quantization_options_are_one_line_errors():
    kw = dict(world_size=2, batch_size=1, seq_len=64)
    cases = [({"quantize": "nf4"}, "lora_rank > 0"),
             ({"quantize": "float8", "lora_rank": 4}, "choose one"),
             ({"quantize": "int3", "lora_rank": 4}, "not one of"),
             ({"lora_rank": -1}, "negative"),
             ({"quantize": "nf4", "lora_rank": 4, "strategy": "no_shard"}, "2-D mesh"),
             ({"quantize": "nf4", "lora_rank": 4, "reshard_after_forward": 2}, "hpZ")]
    for extra, words in cases:
        with pytest.raises(ValueError, match=words):
            estimate("gpt2-124m", **kw, **extra)


@pytest.mark.extended
def test_70b_qlora_fits_two_24gb_gpus_with_offload_and_checkpointing(capsys):
    """The FSDP+QLoRA recipe's case: Llama 70B, NF4 base, LoRA rank 64, bf16, two 24 GB
    GPUs. It needs CPU offload and activation checkpointing; the plan must find that,
    offloading the fewest of the 80 blocks that let it fit."""
    budget = 24 * GIB
    kw = dict(world_size=2, batch_size=1, seq_len=2048, mp_policy=torch.bfloat16,
              quantize="nf4", lora_rank=64)
    result = plan(LLAMA_70B, budget_bytes=budget, allow_offload=True, **kw)
    assert result.choice is not None, result.explain()
    assert result.choice.offload and result.choice.activation_checkpointing
    assert result.choice.strategy == "full_shard"
    assert result.estimate.total * 1.1 <= budget
    k = result.choice.offload_blocks
    assert result.choice.blocks == 80 and 0 < k < 80, result.explain()
    fewer = estimate(LLAMA_70B, offload=f"cpu:{(k - 1) / 80!r}", activation_checkpointing=True,
                     **kw)
    assert fewer.total * 1.1 > budget
    # everything offloaded fits too, and holds on each rank's host half the NF4 blocks
    # (16 GiB), half the fp32 embedding and output layer (4 GiB), the adapters' shards
    # and AdamW states (5 GiB), and what the pinned allocator's power-of-two blocks add to
    # the pinned flat shards and gradients (about 2 GiB); the partial offload keeps the
    # embedding and output layer and 80 - k blocks on the GPU
    full = estimate(LLAMA_70B, offload="cpu", activation_checkpointing=True, **kw)
    assert full.total * 1.1 <= budget
    assert 22 * GIB < full.host_bytes < 31 * GIB
    assert result.estimate.host_bytes < full.host_bytes - 4 * GIB
    # without offload the quantized shards alone take most of the GPU: nothing fits
    assert plan(LLAMA_70B, budget_bytes=budget, **kw).choice is None
    assert "--lora.rank 64 --lora.base nf4" in result.train_flags("bf16")
    assert f"--parallel.offload cpu:{k / 80!r}" in result.train_flags("bf16")


def test_cli_plan_prints_the_qlora_flags(tmp_path, capsys):
    import json
    (tmp_path / "config.json").write_text(json.dumps(
        {**LLAMA_70B, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000}))
    assert fullshard_main(["plan", "--hf-config", str(tmp_path), "--world-size", "2",
                           "--budget-gib", "4", "--seq", "256", "--quantize", "nf4",
                           "--lora-rank", "8", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "nf4 weights, LoRA rank 8" in out
    assert f"fullshard train --model hf:{tmp_path} " in out and "--lora.rank 8" in out
    assert fullshard_main(["estimate", "--hf-config", str(tmp_path), "--world-size", "4",
                           "--seq", "256", "--quantize", "nf4", "--lora-rank", "8",
                           "--sweep"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[-1].split()[0] == "4" and rows[-1].split()[-1] == "-"  # no no_shard


# -- against a real run -----------------------------------------------------------------

# Activations above the 4 MiB mmap threshold (16 x 256 x 512 fp32): smaller ones live
# in glibc's heap, where torchao's dequantization temporaries fragment it beyond what
# the estimate's model of the heap covers (-12% at batch 4 with a 32000 vocabulary).
SMALL_LLAMA = {**LLAMA_70B, "hidden_size": 512, "intermediate_size": 1408,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
               "vocab_size": 8000, "max_position_embeddings": 512}
BATCH, SEQ, RANK = 16, 256, 8


def _qlora_peak(config: dict) -> dict:
    """Peak RSS of 2 AdamW steps of QLoRA (the trainer's add_lora: peft adapters, NF4
    base) on a Llama sharded per decoder layer."""
    import transformers

    from fullshard.train.config.schema import LoraConfig
    from fullshard.train.lora import add_lora

    tune_cpu_allocator()
    tracker = MemoryTracker(warm_up=True)
    fields = dict(config)
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    model = add_lora(model, LoraConfig(rank=RANK, base="nf4"), dist.get_world_size())
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    # The whole fp32 model was built on every rank, mostly below the mmap threshold: its
    # heap pages, free once the shards replace it, are not the step's (fullshard train
    # releases them the same way).
    release_free_heap()
    return tracked_token_steps(model, tracker, config["vocab_size"], BATCH, SEQ,
                               lambda tokens: model(input_ids=tokens, labels=tokens,
                                                    use_cache=False).loss)


@pytest.mark.extended
def test_qlora_estimate_within_15_percent_of_measured_peak():
    """Measured -8% to -11% (torch 2.13 and 2.11): what the estimate misses is glibc's
    heap, fragmented by torchao's dequantization temporaries (docs/memory.md); a missing
    term of the QLoRA model (NF4 bytes, frozen weights' states, the adapters' forward)
    would be more than that."""
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    world = 2
    reports = run_distributed(_qlora_peak, world, SMALL_LLAMA, timeout=300)
    for rank, report in enumerate(reports):
        est = estimate(SMALL_LLAMA, world_size=world, batch_size=BATCH, seq_len=SEQ,
                       quantize="nf4", lora_rank=RANK, device="cpu",
                       process_baseline=report["baseline_bytes"])
        measured = report["peak_bytes"]
        error = (est.total - measured) / measured
        print(f"rank {rank}: measured {measured / MIB:.0f} MiB, estimated "
              f"{est.total / MIB:.0f} MiB ({error:+.1%})\n{est.table()}")
        assert abs(error) <= 0.15, (rank, measured / MIB, est.table())
