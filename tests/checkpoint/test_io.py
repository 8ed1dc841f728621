"""State dicts and checkpoints: exact resume, resharding, atomic commit, verification."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard import checkpoint as ckpt
from fullshard.testing import run_distributed
from fullshard.gpt import GPT, GPTConfig
from support.checkpoint_runs import (CFG, assert_same_optim, full_optim, full_state, sharded_gpt,
                             train_and_save, train_step)

def _resume(path, steps, layout="layers"):
    model = sharded_gpt(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = ckpt.load(path, model, opt)  # the parent: its `latest` is loaded
    losses = [train_step(model, opt, step) for step in range(extra["step"], steps)]
    return extra, losses, full_state(model)


@pytest.mark.slow
def test_exact_resume_in_fresh_processes(tmp_path):
    straight, final = run_distributed(train_and_save, 2, str(tmp_path / "a"), 10)[0]
    first, _ = run_distributed(train_and_save, 2, str(tmp_path / "b"), 5, 5)[0]
    assert first == straight[:5]
    extra, rest, resumed = run_distributed(_resume, 2, str(tmp_path / "b"), 10)[0]
    assert extra == {"step": 5, "note": "hello"}
    assert rest == straight[5:]  # bit-identical
    for k in final:
        assert torch.equal(final[k], resumed[k]), k
    manifest = ckpt.read_manifest(str(tmp_path / "b" / "step_5"))
    assert manifest["world_size"] == 2 and manifest["files"]
    assert (tmp_path / "b" / "latest").read_text() == "step_5"


def _load_full(path, layout, with_optim=False):
    model = sharded_gpt(layout, meta=layout != "plain")
    if layout != "plain":
        model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if with_optim else None
    ckpt.load(path, model, opt)
    return (full_state(model), full_optim(model, opt)) if with_optim else full_state(model)


@pytest.mark.parametrize("save_ws,load_ws,layout", [
    (2, 1, "layers"), (2, 3, "layers"), (4, 2, "layers"), (2, 2, "root_only"),
    (2, 2, "root_zero2")])
@pytest.mark.slow
def test_load_at_another_world_size_or_layout(tmp_path, save_ws, load_ws, layout):
    _, saved, saved_optim = run_distributed(train_and_save, save_ws, str(tmp_path), 2, 2,
                                            True)[0]
    loaded, loaded_optim = run_distributed(_load_full, load_ws, str(tmp_path), layout, True)[0]
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k
    assert_same_optim(saved_optim, loaded_optim)


@pytest.mark.slow
def test_load_into_plain_module_on_one_process(tmp_path):
    _, saved, saved_optim = run_distributed(train_and_save, 2, str(tmp_path), 2, 2, True)[0]
    assert not dist.is_initialized()
    model = sharded_gpt("plain")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.load(str(tmp_path), model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(saved[k], v), k
    assert_same_optim(saved_optim, full_optim(model, opt))


def _die_during_second_save(path):
    model = sharded_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 0)
    ckpt.save(os.path.join(path, "step_1"), model, opt, extra={"step": 1})
    train_step(model, opt, 1)
    real_save = ckpt.io.dcp.save

    def dying_save(*args, **kwargs):
        real_save(*args, **kwargs)
        if dist.get_rank() == 1:
            os._exit(1)  # killed after writing its shards, before the commit
    ckpt.io.dcp.save = dying_save
    ckpt.save(os.path.join(path, "step_2"), model, opt, extra={"step": 2})


def _load_step(path):
    model = sharded_gpt()
    return ckpt.load(path, model)["step"]


@pytest.mark.slow
def test_killed_save_leaves_previous_checkpoint_in_use(tmp_path):
    with pytest.raises(AssertionError, match="exited with code 1"):
        run_distributed(_die_during_second_save, 2, str(tmp_path), timeout=60)
    assert not (tmp_path / "step_2").exists()
    assert (tmp_path / "latest").read_text() == "step_1"
    assert run_distributed(_load_step, 2, str(tmp_path)) == [1, 1]
    with pytest.raises(AssertionError, match="is not a complete checkpoint: .*fullshard.json is missing"):
        run_distributed(_load_step, 2, str(tmp_path / ".step_2.tmp"))


def test_a_save_over_a_checkpoint_of_the_same_name_keeps_latest_loadable(tmp_path):
    from fullshard.checkpoint.layout import being_deleted, being_rewritten, set_aside
    from fullshard.train.checkpoints import _prune

    def model_of(value):
        model = nn.Linear(4, 4)
        nn.init.constant_(model.weight, value)
        return model

    def loaded():
        model = model_of(0.0)
        return ckpt.load(str(tmp_path), model)["value"], model.weight.unique().item()

    path = str(tmp_path / "step_000001")
    ckpt.save(path, model_of(1.0), extra={"value": 1.0})
    # A save over step_000001 killed between its two renames: the older one is set aside
    # (hidden, so no step_N listing shows it) and `latest` still loads it.
    os.replace(path, set_aside(path))
    assert ckpt.resolve(str(tmp_path)) == set_aside(path)
    assert loaded() == (1.0, 1.0)
    assert sorted(os.listdir(tmp_path)) == [".step_000001.replaced", "latest"]
    ckpt.save(path, model_of(2.0), extra={"value": 2.0})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001"]
    assert loaded() == (2.0, 2.0)
    ckpt.save(path, model_of(3.0), extra={"value": 3.0})  # over an existing one
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001"]
    assert loaded() == (3.0, 3.0)
    # killed after the second rename, before removing the older one: the next prune does
    ckpt.save(str(tmp_path / "step_000002"), model_of(4.0), extra={"value": 4.0})
    os.makedirs(set_aside(path))
    _prune(str(tmp_path), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000001", "step_000002"]
    # a prune killed while deleting, and a rewrite of `latest` killed: the next prune
    # deletes the one, the next save replaces the other, and neither is ever in sight
    os.makedirs(being_deleted(str(tmp_path / "step_000000")))
    with open(being_rewritten(str(tmp_path / "latest")), "w") as f:
        f.write("step_0")
    _prune(str(tmp_path), keep=1)
    assert sorted(os.listdir(tmp_path)) == [".latest.partial", "latest", "step_000002"]
    ckpt.save(str(tmp_path / "step_000003"), model_of(5.0), extra={"value": 5.0})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000002", "step_000003"]
    assert loaded() == (5.0, 5.0)



def test_a_set_aside_checkpoint_resumed_from_is_pruned_once_a_newer_one_is_committed(tmp_path):
    from fullshard.checkpoint.layout import set_aside
    from fullshard.train.checkpoints import _prune

    path = str(tmp_path / "step_000001")
    ckpt.save(path, nn.Linear(4, 4), extra={"step": 1})
    os.replace(path, set_aside(path))  # a save over it killed between its renames
    assert ckpt.load(str(tmp_path), nn.Linear(4, 4)) == {"step": 1}  # what a resume reads
    ckpt.save(str(tmp_path / "step_000002"), nn.Linear(4, 4), extra={"step": 2})
    _prune(str(tmp_path), keep=3)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_000002"]

@pytest.mark.slow
def test_corrupt_missing_and_incompatible_checkpoints_are_named(tmp_path):
    run_distributed(train_and_save, 2, str(tmp_path), 1, 1)
    step = tmp_path / "step_1"
    shard = sorted(p for p in step.iterdir() if p.suffix == ".distcp")[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match=f"{shard.name} is corrupt"):
        run_distributed(_load_step, 2, str(step))
    shard.unlink()
    with pytest.raises(AssertionError, match=f"{shard.name} is missing"):
        run_distributed(_load_step, 2, str(step))
    other = tmp_path / "other"
    run_distributed(train_and_save, 2, str(other), 1, 1)
    wide = nn.Sequential(nn.Linear(3, 5))
    with pytest.raises(ckpt.CheckpointError, match=r"does not fit this model: missing from "
                                                   r"the checkpoint: 0.bias, 0.weight \| in the "
                                                   r"checkpoint but not the model: layers.0"):
        ckpt.load(str(other), wide)
    bigger_vocab = GPT(GPTConfig(vocab_size=48, seq_len=8, d_model=16, n_layers=3, n_heads=2))
    with pytest.raises(ckpt.CheckpointError, match=r"shape mismatches: tok_emb.weight: "
                                                   r"checkpoint \(40, 16\), model \(48, 16\)"):
        ckpt.load(str(other), bigger_vocab)


def _state_dict_functions():
    model = sharded_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 0)
    rank = dist.get_rank()
    sharded = ckpt.get_model_state_dict(model)
    assert all(isinstance(v, DTensor) for v in sharded.values())
    full = ckpt.get_model_state_dict(model, options=ckpt.StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert set(full) == set(sharded) and not any(isinstance(v, DTensor)
                                                     for v in full.values())
    else:
        assert full == {}  # only rank 0 keeps the gathered tensors
    osd = ckpt.get_optimizer_state_dict(model, opt)
    assert "layers.0.attn.qkv.weight" in osd["state"]
    # a meta-initialized model loads rank 0's full state dict by broadcast
    fresh = sharded_gpt(meta=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ckpt.set_model_state_dict(fresh, full, options=ckpt.StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
    # torch's DCP internals about its fallback device, which a user cannot act on
    assert not [str(w.message) for w in said if "default" in str(w.message)], \
        [str(w.message) for w in said]
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt.set_optimizer_state_dict(fresh, fresh_opt, osd)
    assert train_step(fresh, fresh_opt, 1) == train_step(model, opt, 1)
    return True


@pytest.mark.slow
def test_state_dict_functions_full_sharded_broadcast():
    assert all(run_distributed(_state_dict_functions, 2))


def _load_with_torch_fsdp2(path):
    """The checkpoint directory is plain DCP: torch loads it into a model sharded by
    PyTorch's own FSDP2, with no fullshard code involved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, \
        set_model_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        torch_fully_shard(layer)
    torch_fully_shard(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=os.path.join(path, "step_2"))
    set_model_state_dict(model, state["model"])
    return full_state(model)


@pytest.mark.slow
def test_torch_dcp_loads_the_checkpoint_into_fsdp2(tmp_path):
    _, saved = run_distributed(train_and_save, 2, str(tmp_path), 2, 2)[0]
    loaded = run_distributed(_load_with_torch_fsdp2, 2, str(tmp_path))[0]
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def _async_save_then_keep_training(path):
    model = sharded_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        train_step(model, opt, step)
    snapshot = full_state(model)
    future = ckpt.save(os.path.join(path, "step_2"), model, opt, extra={"step": 2},
                       async_save=True)
    for step in range(2, 5):  # training goes on while the shards are written
        train_step(model, opt, step)
    assert future.result() == os.path.join(path, "step_2")
    # the next save waits for the one in flight, then commits after it
    ckpt.save(os.path.join(path, "step_5"), model, opt, extra={"step": 5}, async_save=True)
    ckpt.save(os.path.join(path, "step_5b"), model, opt, extra={"step": 5})
    return snapshot


@pytest.mark.slow
def test_async_save_writes_the_state_at_the_call(tmp_path):
    snapshot = run_distributed(_async_save_then_keep_training, 2, str(tmp_path))[0]
    loaded = run_distributed(_load_full, 2, str(tmp_path / "step_2"), "layers")[0]
    for k in snapshot:
        assert torch.equal(snapshot[k], loaded[k]), k
    assert (tmp_path / "latest").read_text() == "step_5b"
    assert ckpt.read_manifest(str(tmp_path / "step_5"))["world_size"] == 2


@pytest.mark.slow
def test_cli_inspect_and_streamed_safetensors_export(tmp_path, capsys):
    from safetensors.torch import load_file

    from fullshard.cli import main

    _, saved = run_distributed(train_and_save, 2, str(tmp_path), 2, 2)[0]
    assert main(["ckpt", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "world size 2, with optimizer state" in out and "checksums: ok" in out
    assert "{'step': 2, 'note': 'hello'}" in out
    assert "layers.0.attn.qkv.weight" in out and "(48, 16)" in out
    target = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(tmp_path), str(target)]) == 0
    exported = load_file(str(target))
    assert exported.keys() == saved.keys()
    for k in saved:
        assert torch.equal(exported[k], saved[k]), k
    shard = sorted((tmp_path / "step_2").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])
    assert main(["ckpt", "inspect", str(tmp_path)]) == 1
    assert "truncated" in capsys.readouterr().out


class _WithIdleBranch(nn.Module):
    """A layer the forward never uses (an expert no token reached): no gradient, so the
    optimizer holds it but has no state for it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.idle = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.used(x)


def _idle_run(path, kind, steps, load=False, skip_idle=False):
    from fullshard import fully_shard
    model = _WithIdleBranch()
    fully_shard(model.used)
    fully_shard(model)
    params = [p for n, p in model.named_parameters() if not (skip_idle and n.startswith("idle"))]
    opt = (torch.optim.SGD(params, lr=0.1, momentum=0.9) if kind == "sgd"
           else torch.optim.AdamW(params, lr=0.1))
    first = 0
    if load:
        ckpt.load(path, model, opt)
        first = 2
        assert all(not opt.state[p] for p in model.idle.parameters())  # as saved: no state
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(3, 6, generator=g) for _ in range(steps)]
    for x in xs[first:]:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    if not load and path is not None:
        ckpt.save(path, model, opt)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _idle_parameters(path):
    out = {}
    for kind in ("sgd", "adamw"):
        straight = _idle_run(None, kind, 4)
        _idle_run(f"{path}/{kind}", kind, 2)
        resumed = _idle_run(f"{path}/{kind}", kind, 4, load=True)
        out[kind] = max((straight[k] - resumed[k]).abs().max().item() for k in straight)
    _idle_run(f"{path}/without", "sgd", 2, skip_idle=True)
    with pytest.raises(ckpt.CheckpointError) as err:
        _idle_run(f"{path}/without", "sgd", 4, load=True)
    out["not held"] = str(err.value)
    return out


def test_parameters_the_optimizer_had_not_stepped_resume_without_state(tmp_path):
    """torch's DCP path (get_optimizer_state_dict, then dcp.load) fails on such a checkpoint
    ("Missing key in checkpoint state_dict: ...momentum_buffer"); fullshard's load leaves
    those parameters without state, as the saved optimizer had them."""
    out = run_distributed(_idle_parameters, 2, str(tmp_path))[0]
    assert out["sgd"] == 0.0 and out["adamw"] == 0.0, out
    # a parameter the saved optimizer did not hold at all is still named as missing
    assert "does not fit this optimizer (missing from the checkpoint: optim.state.idle." \
        in out["not held"], out["not held"]
