"""Hybrid sharding (HSDP): a 2-D (replicate, shard) mesh at world size 4 as 2 x 2."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fullshard import checkpoint as ckpt
from fullshard import fully_shard
from fullshard.testing import run_distributed
from fullshard.testing import models as m
from fullshard.testing.counting import count_collectives
from fullshard.testing.parity import check_parity
from fullshard.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=48, seq_len=12, d_model=24, n_layers=3, n_heads=4)


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _hsdp(model, mesh, raf=True):
    for layer in getattr(model, "layers", []):
        fully_shard(layer, mesh=mesh, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf)


def _gpt_batch(step, n):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def _parity(case, raf):
    mesh = _mesh()
    if case == "gpt":
        build, batch, opt = (lambda: GPT(CFG)), _gpt_batch, "sgd"
        loss = lambda model, b: lm_loss(model(b[0]), b[1])  # noqa: E731
    else:
        build, opt, loss = m.OddMLP, "adamw", m.mse_loss
        batch = lambda s, n: m.float_batch(s, n, 7, 3)  # noqa: E731
    report = check_parity(build, lambda model: _hsdp(model, mesh, raf),
                          lambda s: batch(s, 8), loss, optimizer=opt, steps=5)
    return report.losses


@pytest.mark.parametrize("raf", [True, False], ids=["zero3", "zero2"])
@pytest.mark.parametrize("case", ["gpt", "mlp"])
@pytest.mark.slow
def test_hybrid_parity_2x2(case, raf):
    run_distributed(_parity, 4, case, raf)


def _layout_and_checkpoint(path):
    mesh = _mesh()
    torch.manual_seed(0)
    model = GPT(CFG)
    _hsdp(model, mesh)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Replicate(), Shard(0))
        assert p.to_local().shape[0] == -(-p.shape[0] // 2) or p.shape[0] < 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _gpt_batch(dist.get_rank(), 2)
    with count_collectives() as counts:
        lm_loss(model(x), y).backward()
    opt.step()
    # shard-group collectives only (the replica all-reduce is a separate step)
    assert counts["reduce_scatter"] >= 1
    sd = ckpt.get_model_state_dict(model)
    assert all(v.placements == (Replicate(), Shard(0)) for v in sd.values())
    ckpt.save(os.path.join(path, "step_1"), model, opt, extra={"step": 1})
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _load_1d(path):
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    ckpt.load(path, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_hybrid_state_dicts_and_checkpoints(tmp_path):
    saved = run_distributed(_layout_and_checkpoint, 4, str(tmp_path))[0]
    loaded = run_distributed(_load_1d, 2, str(tmp_path))[0]
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def _hpz_parity(case):
    if case == "gpt":
        build, opt = (lambda: GPT(CFG)), "sgd"
        batch = _gpt_batch
        loss = lambda model, b: lm_loss(model(b[0]), b[1])  # noqa: E731
    else:
        build, opt, loss = m.OddMLP, "adamw", m.mse_loss
        batch = lambda s, n: m.float_batch(s, n, 7, 3)  # noqa: E731

    def shard(model):
        for path in ("layers.0", "layers.1", "layers.2") if case == "gpt" else ("blocks.0",):
            fully_shard(model.get_submodule(path), reshard_after_forward=2)
        fully_shard(model, reshard_after_forward=2)
        model.set_bucket_numel(0)
    return check_parity(build, shard, lambda s: batch(s, 8), loss, optimizer=opt,
                        steps=5).losses


@pytest.mark.parametrize("case", ["gpt", "mlp"])
@pytest.mark.slow
def test_reshard_after_forward_int_parity(case):
    run_distributed(_hpz_parity, 4, case)


def _hpz_collective_sizes():
    from fullshard.core import group as group_module
    from fullshard.core import post_forward as post_forward_module

    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=2)
    fully_shard(model)
    model.set_bucket_numel(0)
    seen = []
    real = group_module.all_gather

    def recording(out, shard, pg, async_op=False, **kwargs):
        seen.append((phase[0], pg.size(), out.numel()))
        return real(out, shard, pg, async_op=async_op, **kwargs)
    phase = ["forward"]
    group_module.all_gather = post_forward_module.all_gather = recording
    try:
        x, y = _gpt_batch(dist.get_rank(), 2)
        loss = lm_loss(model(x), y)
        phase[0] = "backward"
        loss.backward()
    finally:
        group_module.all_gather = post_forward_module.all_gather = real
    return seen


@pytest.mark.slow
def test_reshard_after_forward_int_gathers_within_the_smaller_group():
    """Forward gathers over all 4 ranks; backward re-gathers each layer from 2 ranks."""
    seen = run_distributed(_hpz_collective_sizes, 4)[0]
    forward = [s for s in seen if s[0] == "forward"]
    backward = [s for s in seen if s[0] == "backward"]
    assert forward and all(size == 4 for _, size, _ in forward)
    assert len(backward) == CFG.n_layers and all(size == 2 for _, size, _ in backward)
