"""QLoRA in the trainer: LoRA adapters (peft) on a tiny Llama whose base weights are
NF4 (torchao), sharded at world size 2; the base stays as loaded, the adapters train."""

import pytest
import torch
import torch.distributed as dist

from fullshard.testing import run_distributed
from fullshard.train.config.schema import get_preset
from fullshard.train.config.flags import apply_overrides
from fullshard.train.launch.launcher import Worker
from fullshard.train.loop import Trainer
from fullshard.cli import main as fullshard_main
from support.hf_folders import save_tiny_llama, write_jsonl_dataset

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")


def _checkpoint_adapters(run: str) -> dict[str, torch.Tensor]:
    """The adapters in the run's latest checkpoint, read with torch's DCP alone, under
    peft's names (without the adapter's name)."""
    import torch.distributed.checkpoint as dcp

    from fullshard.checkpoint.export import model_tensors
    from fullshard.train.checkpoints import resolve_checkpoint

    path = resolve_checkpoint(run)
    state = {f"model.{name}": torch.empty(m.size, dtype=m.properties.dtype)
             for name, m in model_tensors(path).items() if ".lora_" in name}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return {name.removeprefix("model.").replace(".default.", "."): t
            for name, t in state.items()}


def _frozen_shards(model) -> dict:
    """Each frozen parameter's local shard (an NF4 one as its inner tensors), copied."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        local = p._local_tensor
        inner = local.__tensor_flatten__()[0] if type(local) is not torch.Tensor else [None]
        for attr in inner:
            out[(name, attr)] = (getattr(local, attr) if attr else local).detach().clone()
    return out


def _qlora(model_dir: str, data: str, out: str, base: str) -> dict:
    cfg = apply_overrides(get_preset("debug"), {
        "model": f"hf:{model_dir}", "data": data, "steps": 4, "batch.seq_len": 16,
        "batch.batch_size": 2, "optim.lr": 1e-2, "optim.warmup_steps": 1, "eval.every": 0,
        "eval.sample_tokens": 4, "checkpoint.every": 0, "lora.rank": 4,
        "lora.base": base}, "test")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(cfg, out, Worker(rank, world, rank, world, torch.device("cpu")))
    model = trainer.model
    frozen = _frozen_shards(model)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()
              if p.requires_grad}
    trainer.run(resume=False)
    after = {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    optimized = {id(p) for opt in trainer.optimizers for g in opt.param_groups
                 for p in g["params"]}
    return {
        "adapters": sorted(before),
        "changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
        "frozen_kept": all(torch.equal(a, b) for a, b in zip(frozen.values(),
                                                             _frozen_shards(model).values())),
        "nf4": sorted(n for n, p in model.named_parameters()
                      if type(p._local_tensor).__name__ == "NF4Tensor"),
        "only_adapters_optimized": optimized == {id(p) for p in model.parameters()
                                                 if p.requires_grad},
        "losses": [r["loss"] for r in trainer.log.records if "loss" in r]
        if trainer.log is not None else None,
    }


@pytest.mark.parametrize("base", ["nf4", pytest.param("fp32", marks=pytest.mark.extended)])
@pytest.mark.slow
def test_qlora_trains_only_the_adapters_over_a_sharded_nf4_base(tmp_path, base):
    save_tiny_llama(str(tmp_path / "llama"))
    write_jsonl_dataset(tmp_path / "data.jsonl")
    out = run_distributed(_qlora, 2, str(tmp_path / "llama"), str(tmp_path / "data.jsonl"),
                          str(tmp_path / "run"), base, timeout=240)[0]
    assert out["adapters"] and all(".lora_" in n for n in out["adapters"])
    lora_b = [n for n in out["adapters"] if ".lora_B." in n]
    assert set(lora_b) <= set(out["changed"])  # B starts at zero and must have moved
    assert out["frozen_kept"] and out["only_adapters_optimized"]
    linear = 7 * 2  # q, k, v, o, gate, up, down in each of the 2 blocks
    assert len(out["nf4"]) == (linear if base == "nf4" else 0)
    assert len(out["losses"]) == 4 and all(map(torch.isfinite, map(torch.tensor, out["losses"])))
    # the adapters as peft saves them: PeftModel.from_pretrained loads the trained values
    exported = tmp_path / "adapters"
    assert fullshard_main(["ckpt", "export", str(tmp_path / "run"), str(exported),
                           "--adapters"]) == 0
    saved = _checkpoint_adapters(str(tmp_path / "run"))
    base_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"))
    loaded = {n.replace(".default.", "."): t for n, t in
              peft.PeftModel.from_pretrained(base_model, str(exported)).state_dict().items()}
    assert saved and set(saved) == {n for n in loaded if ".lora_" in n}
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    assert any(not torch.equal(t, torch.zeros_like(t)) for n, t in saved.items()
               if ".lora_B." in n)


def _run_losses(model_dir: str, data: str, base: str, batch_size: int,
                extra: dict | None = None) -> list | None:
    from support.train_runs import train_losses
    return train_losses({"model": f"hf:{model_dir}", "data": data, "batch.seq_len": 16,
                    "batch.batch_size": batch_size, "optim.lr": 1e-2,
                    "optim.warmup_steps": 1, "lora.rank": 4, "lora.base": base,
                    **(extra or {})})


def _composed(model_dir: str, data: str) -> dict | None:
    """The same QLoRA run plain, with CPU offload and activation checkpointing, and in
    bf16 (in one set of ranks: their losses, rank 0's)."""
    variants = {"plain": {}, "offload_ac": {"parallel.offload": True,
                                            "parallel.activation_checkpointing": True},
                "bf16": {"parallel.precision": "bf16"}}
    return {name: _run_losses(model_dir, data, "nf4", 2, extra)
            for name, extra in variants.items()}


@pytest.mark.extended
def test_qlora_composes_with_cpu_offload_checkpointing_and_bf16(tmp_path):
    # On a CPU-only machine host and device are one: offload runs its copies, not a
    # transfer between devices
    save_tiny_llama(str(tmp_path / "llama"))
    write_jsonl_dataset(tmp_path / "data.jsonl")
    out = run_distributed(_composed, 2, str(tmp_path / "llama"), str(tmp_path / "data.jsonl"),
                          timeout=300)[0]
    assert len(out["plain"]) == 4
    assert out["offload_ac"] == pytest.approx(out["plain"], rel=1e-5, abs=1e-6)
    # bf16 computes the adapters and the dequantized base in bf16: close, not equal
    assert out["bf16"] == pytest.approx(out["plain"], rel=2e-2)
    assert out["bf16"] != out["plain"]


@pytest.mark.parametrize("base", ["nf4", pytest.param("fp32", marks=pytest.mark.extended)])
@pytest.mark.slow
def test_qlora_at_two_ranks_trains_as_one_process_on_the_same_batches(tmp_path, base):
    save_tiny_llama(str(tmp_path / "llama"))
    write_jsonl_dataset(tmp_path / "data.jsonl")
    args = (str(tmp_path / "llama"), str(tmp_path / "data.jsonl"), base)
    sharded = run_distributed(_run_losses, 2, *args, 2, timeout=240)[0]
    single = run_distributed(_run_losses, 1, *args, 4, timeout=240)[0]
    assert len(single) == 4
    assert sharded == pytest.approx(single, rel=1e-5, abs=1e-6)


def _run(model_dir: str, data: str, out: str, steps: int, resume: bool) -> list | None:
    cfg = apply_overrides(get_preset("debug"), {
        "model": f"hf:{model_dir}", "data": data, "steps": steps, "batch.seq_len": 16,
        "batch.batch_size": 2, "optim.lr": 1e-2, "optim.warmup_steps": 1, "eval.every": 0,
        "eval.sample_tokens": 0, "checkpoint.every": 2, "lora.rank": 4}, "test")
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(cfg, out, Worker(rank, world, rank, world, torch.device("cpu")))
    trainer.run(resume=resume)
    if trainer.log is None:
        return None
    return [(r["step"], r["loss"]) for r in trainer.log.records if "loss" in r]


def _refused(model_dir: str, data: str, out: str) -> str:
    from fullshard.train.config.schema import ConfigError
    try:
        _run(model_dir, data, out, 6, True)
    except ConfigError as err:
        return f"ConfigError: {err}"
    return "NO ERROR RAISED"


def test_nf4_block_sizes_fall_back_to_the_whole_weight_so_fully_shard_names_it():
    """A weight no NF4 block size splits over the ranks still quantizes (then E107
    names it at fully_shard) instead of failing inside torchao."""
    from fullshard.train.lora import nf4_block_sizes
    assert nf4_block_sizes(32 * 32, 2) == (64, 8)
    assert nf4_block_sizes(32 * 32, 3) == (64, 16)  # 3 ranks: none; sizes for the whole
    to_nf4 = pytest.importorskip("torchao.quantization").to_nf4
    to_nf4(torch.randn(32, 32), *nf4_block_sizes(32 * 32, 3))


@pytest.mark.extended
def test_a_qlora_run_resumed_from_its_checkpoint_continues_like_a_straight_run(tmp_path):
    save_tiny_llama(str(tmp_path / "llama"))
    write_jsonl_dataset(tmp_path / "data.jsonl")
    args = (str(tmp_path / "llama"), str(tmp_path / "data.jsonl"))
    straight = run_distributed(_run, 2, *args, str(tmp_path / "straight"), 4, False,
                               timeout=240)[0]
    run_distributed(_run, 2, *args, str(tmp_path / "resumed"), 2, False, timeout=240)
    resumed = run_distributed(_run, 2, *args, str(tmp_path / "resumed"), 4, True,
                              timeout=240)[0]
    assert [s for s, _ in straight] == [1, 2, 3, 4]
    # the log holds the first run's steps 1-2 and the resumed 3-4: bit for bit the
    # straight run's (adapters, optimizer, NF4 base and data position restored)
    assert resumed == straight
    # at another world size the NF4 shards (their blocks chosen per world size) cannot
    # load: one line naming the world size it resumes at, before anything is read
    refused = run_distributed(_refused, 1, *args, str(tmp_path / "resumed"), timeout=240)[0]
    from support.catalogue import matches_documented
    assert matches_documented("E171", refused), refused
