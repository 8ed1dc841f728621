"""Hybrid sharding (HSDP): a 2-D (replicate, shard) mesh at world size 4 as 2 x 2 (the
mesh and its groups, core/mesh.py)."""

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
    return m.token_batch(step, n, CFG.vocab_size, CFG.seq_len)


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


def _replica_reduce_order():
    """Which collectives each unit's gradients go through, in the order they are issued
    and waited for (spies on the two PendingReduce stages)."""
    from fullshard.core import gradients

    mesh = _mesh()
    torch.manual_seed(0)
    model = GPT(CFG)
    _hsdp(model, mesh)
    model.set_bucket_numel(0)
    events = []
    real_start, real_finish = (gradients.PendingReduce.start_replica_reduce,
                               gradients.PendingReduce.finish)

    def start(self, patience=None):
        started = real_start(self, patience)
        if started:
            events.append(f"all-reduce started {self.unit_name}")
        return started

    def finish(self, patience=None):
        events.append(f"finished {self.unit_name}")
        return real_finish(self, patience)

    gradients.PendingReduce.start_replica_reduce = start
    gradients.PendingReduce.finish = finish
    try:
        x, y = _gpt_batch(0, 2)
        lm_loss(model(x), y).backward()
    finally:
        gradients.PendingReduce.start_replica_reduce = real_start
        gradients.PendingReduce.finish = real_finish
    return events


def test_the_replica_all_reduce_stays_in_flight_while_the_next_unit_reduces():
    """Note [the replica all-reduce in flight]: a unit's all-reduce across replicas is
    started when the next unit's reduce-scatter is about to be issued, and finished one
    unit later, not waited for as soon as it is issued."""
    for events in run_distributed(_replica_reduce_order, 4):
        assert events[:4] == ["all-reduce started layers.2", "all-reduce started layers.1",
                              "finished layers.2", "all-reduce started layers.0"], events
        assert sorted(e for e in events if e.startswith("finished")) == [
            "finished GPT", "finished layers.0", "finished layers.1", "finished layers.2"]
