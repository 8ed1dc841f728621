"""Training on two-dimensional meshes, as torch's FSDP2 tests check it
(test_fully_shard_training.py's HSDP and 2-D tests, test_fully_shard_2d.py,
test_fully_shard_dtensor.py), in our own words, at four ranks:

- HSDP on a (replicate, shard) mesh: a LayerNorm and MLPs as units, hidden widths
  that do not divide (3, 17) or do (16), ``reshard_after_forward`` True/False,
  activation checkpointing, gradients reduced every micro-batch or on the last only;
- data parallel x tensor parallel: torch's ``parallelize_module`` (column- then
  row-wise, activations kept as DTensors between the MLPs) on ``mesh["tp"]``, then
  units on ``mesh["dp"]``; every parameter ends a DTensor on the (dp, tp) mesh;
- the whole mesh given with ``dp_mesh_dims``: parameters made DTensors first
  (``distribute_module``), sharded on the data-parallel dimension (1-D, HSDP, and
  with tensor parallelism, ``shard_placement_fn`` keeping off the TP dimension, also
  HSDP x TP on a 3-D mesh), on several shard or replicate dimensions, or replicated
  alone (DDP),
  the placements torch gives, an unused expert-parallel parameter reduced to zeros
  (``set_reduce_scatter_unused_params``), and what torch refuses refused with
  torch's words.

Each case trains beside a single-process copy fed every rank's rows
(tests/support/cast_reference.py). Ranks sum gradients in another order than the copy
does (two reductions under HSDP), so values match to fp32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (DTensor, Replicate, Shard, distribute_module,
                                      distribute_tensor)
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from support.cast_reference import CastReference, assert_same_shards
from fullshard import DataParallelMeshDims, fully_shard
from fullshard.testing import run_distributed

CLOSE = {"rtol": 1e-5, "atol": 1e-6}


class _MLP(nn.Module):
    def __init__(self, dim: int, multiplier: int = 4):
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * multiplier)
        self.out_proj = nn.Linear(dim * multiplier, dim)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def _rows(n: int, dim: int, seed: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(n, dim, generator=g)


def _train(model, master, what: str, batch, *, steps: int = 3, micro: int = 1,
           sync_last_only: bool = False) -> None:
    """Adam on both; losses every micro-batch, shards and gradients every step.
    ``batch(step)`` is this rank's input (a tensor, or a DTensor for SPMD models)."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, None, None)
    for step in range(steps):
        for m in range(micro):
            if sync_last_only:
                model.set_requires_gradient_sync(m == micro - 1)
            x = batch(step * micro + m)
            loss = model(x).sum()
            loss.backward()
            local = x.to_local() if isinstance(x, DTensor) else x
            ref_loss = reference.forward_backward(lambda r: r(local).sum())
            got = loss.full_tensor() if isinstance(loss, DTensor) else loss
            torch.testing.assert_close(got.detach(), ref_loss, **CLOSE,
                                       msg=lambda e: f"{what}, step {step}.{m}: {e}")
        reference.reduce()
        assert_same_shards(model, master, f"{what}, step {step}", **CLOSE)
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        reference.step(set_to_none=step % 2 == 0)
    assert_same_shards(model, master, f"{what}, trained", grads=False, **CLOSE)


def _hsdp(mesh, dim: int, reshard: bool, checkpointed: bool, sync_last_only: bool) -> None:
    what = (f"HSDP dim {dim}, reshard {reshard}, checkpointed {checkpointed}, "
            f"sync on the last micro-batch only {sync_last_only}")
    torch.manual_seed(42)
    model = nn.Sequential(nn.LayerNorm(dim, bias=False), _MLP(dim, 3), _MLP(dim), _MLP(dim, 3))
    master = copy.deepcopy(model)
    for block in model:
        if checkpointed:
            checkpoint(block)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    _train(model, master, what, lambda s: _rows(4, dim, dist.get_rank(), s), micro=3,
           sync_last_only=sync_last_only)


_COLUMN_THEN_ROW = {f"{i}.{name}": style(use_local_output=False)
                    for i in range(3) for name, style in
                    (("in_proj", ColwiseParallel), ("out_proj", RowwiseParallel))}
_COLUMN_THEN_ROW["2.out_proj"] = RowwiseParallel()  # a plain tensor out, for the loss


def _dp_tp(mesh, dim: int, reshard: bool, checkpointed: bool) -> None:
    what = f"dp x tp dim {dim}, reshard {reshard}, checkpointed {checkpointed}"
    torch.manual_seed(42)
    model = nn.Sequential(_MLP(dim, 3), _MLP(dim), _MLP(dim, 3))
    master = copy.deepcopy(model)
    model = parallelize_module(model, mesh["tp"], _COLUMN_THEN_ROW)
    for block in model:
        if checkpointed:
            checkpoint(block)
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)
    dp_rank = mesh["dp"].get_local_rank()  # tensor-parallel peers see the same rows
    _train(model, master, what, lambda s: _rows(4, dim, dp_rank, s))
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and len(p.placements) == 2, name
        assert p.device_mesh.mesh_dim_names == ("dp", "tp"), name


def _replicated_rows(mesh, dp_rank: int):
    """This data-parallel rank's rows as a DTensor replicated on every dimension: each
    rank computes on its own batch, as torch's test does (DDP-like)."""
    return lambda s: DTensor.from_local(_rows(2, 16, dp_rank, s), mesh,
                                        [Replicate()] * mesh.ndim, run_check=False)


def _tp_partition(name, module, mesh):
    """Column-split ``in_proj``, row-split ``out_proj`` on the last mesh dimension."""
    if not isinstance(module, nn.Linear):
        return
    for pname, p in list(module.named_parameters(recurse=False)):
        tp = (Shard(0) if "in_proj" in name else Shard(1)) if pname == "weight" else Replicate()
        module.register_parameter(pname, nn.Parameter(
            distribute_tensor(p.detach(), mesh, [Replicate()] * (mesh.ndim - 1) + [tp])))


def _off_the_tp_dim(p):
    """Shard on dim 1 where tensor parallelism holds dim 0, as torch's test does."""
    return Shard(1) if any(isinstance(pl, Shard) and pl.dim == 0 for pl in p.placements) \
        else Shard(0)


def _spmd(sizes, names, dims: DataParallelMeshDims, tp: bool, reshard: bool) -> None:
    what = f"dp_mesh_dims {dims} on {names}, reshard {reshard}"
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    torch.manual_seed(42)
    model = _MLP(16)
    master = copy.deepcopy(model)
    distribute_module(model, mesh, _tp_partition if tp else None)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, dp_mesh_dims=dims,
                shard_placement_fn=_off_the_tp_dim if tp else None)
    shard = (dims.shard,) if isinstance(dims.shard, str) else tuple(dims.shard or ())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), (what, name)
        if len(shard) > 1:  # the shard dimensions flattened into one, as torch does
            assert p.device_mesh.mesh_dim_names == ("_".join(shard),), (what, name)
            assert p.placements == (Shard(0),), (what, name, p.placements)
            continue
        assert p.device_mesh == mesh, (what, name)
        assert len(p.placements) == mesh.ndim, (what, name, p.placements)
        if not shard:  # replicate alone: every parameter whole on every rank
            assert p.placements == (Replicate(),) * mesh.ndim, (what, name, p.placements)
            assert p.to_local().shape == p.shape, (what, name)
            continue
        shard_dim = names.index(shard[0])
        expected = 1 if tp and name == "in_proj.weight" else 0
        assert p.placements[shard_dim] == Shard(expected), (what, name, p.placements)
        if tp:
            assert p.placements[-1] == {"in_proj.weight": Shard(0), "out_proj.weight": Shard(1)
                                        }.get(name, Replicate()), (what, name, p.placements)
    dp_rank = mesh[shard[0]].get_local_rank() if tp else dist.get_rank()
    _train(model, master, what, _replicated_rows(mesh, dp_rank))


class _TwoExperts(nn.Module):
    """Two expert-parallel weights; the forward uses one only."""

    def __init__(self, ep_mesh):
        super().__init__()
        self.used = nn.Parameter(distribute_tensor(torch.randn(8, 4), ep_mesh, [Shard(0)]))
        self.unused = nn.Parameter(distribute_tensor(torch.randn(8, 4), ep_mesh, [Shard(0)]))

    def forward(self, x):
        return self.used.to_local().sum() + x.sum() * 0


def _unused_expert_parameter() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = _TwoExperts(mesh["ep"])
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)
    model.set_reduce_scatter_unused_params(True)
    model(torch.ones(1)).backward()
    grad = model.unused.grad
    assert isinstance(grad, DTensor) and torch.count_nonzero(grad.to_local()) == 0
    assert torch.count_nonzero(model.used.grad.to_local()) > 0


def _refused(fn, kind: type, words: str) -> None:
    with pytest.raises(kind, match=words):
        fn()


def _spmd_refusals() -> None:
    """What torch refuses, refused with torch's exception type and words first."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))  # a name no case used

    def distributed(*placements) -> nn.Linear:
        linear = nn.Linear(16, 32)
        for name, p in list(linear.named_parameters()):
            setattr(linear, name, nn.Parameter(
                distribute_tensor(p.detach(), mesh, placements if name == "weight"
                                  else [Replicate()])))
        return linear
    shard = DataParallelMeshDims(shard="fsdp")
    _refused(lambda: fully_shard(distributed(Shard(0)), mesh=mesh, dp_mesh_dims=shard),
             ValueError, "Expected Replicate")
    _refused(lambda: fully_shard(distributed(Replicate()), mesh=mesh,
                                 dp_mesh_dims=DataParallelMeshDims(shard="nonexistent")),
             ValueError, "not found in mesh.mesh_dim_names")
    _refused(DataParallelMeshDims, ValueError, "At least one of shard or replicate")
    _refused(lambda: fully_shard(_MLP(16), mesh=mesh, dp_mesh_dims=shard),
             ValueError, "must be DTensors")
    _refused(lambda: fully_shard(distributed(Replicate()), mesh=mesh, dp_mesh_dims=shard,
                                 reshard_after_forward=2),
             NotImplementedError, "reshard_after_forward as int")


def _spmd_cases() -> None:
    # each case's mesh names its dimensions apart: torch's FSDP2 keeps the first mesh a
    # dimension name was used with and refuses another mesh object later
    for reshard, name in ((True, "fsdp0"), (False, "fsdp1")):
        _spmd((4,), (name,), DataParallelMeshDims(shard=name), tp=False, reshard=reshard)
    _spmd((2, 2), ("rep", "shard"), DataParallelMeshDims(shard="shard", replicate="rep"),
          tp=False, reshard=True)
    for reshard, names in ((True, ("fsdp2", "tp0")), (False, ("fsdp3", "tp1"))):
        _spmd((2, 2), names, DataParallelMeshDims(shard=names[0]), tp=True, reshard=reshard)
    # replicate alone (DDP), several shard dimensions, several replicate dimensions, and
    # HSDP with tensor parallelism on a 3-D mesh
    _spmd((4,), ("ddp",), DataParallelMeshDims(replicate="ddp"), tp=False, reshard=True)
    _spmd((2, 2), ("dp0", "dp1"), DataParallelMeshDims(shard=("dp0", "dp1")), tp=False,
          reshard=True)
    _spmd((1, 2, 2), ("ddp1", "ddp2", "fsdp4"),
          DataParallelMeshDims(shard="fsdp4", replicate=("ddp1", "ddp2")), tp=False,
          reshard=True)
    _spmd((1, 2, 2), ("rep0", "fsdp5", "tp2"),
          DataParallelMeshDims(shard="fsdp5", replicate="rep0"), tp=True, reshard=True)
    _unused_expert_parameter()
    _spmd_refusals()


def _two_dimensional_cases() -> None:
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    # every setting once, each width at least once (torch runs the full product)
    for dim, reshard, checkpointed, sync_last_only in ((3, True, False, False),
                                                       (16, False, True, True),
                                                       (17, True, True, True),
                                                       (16, True, False, True)):
        _hsdp(hsdp, dim, reshard, checkpointed, sync_last_only)
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim, reshard, checkpointed in ((3, False, True), (16, True, False), (17, True, True)):
        _dp_tp(dp_tp, dim, reshard, checkpointed)
    _spmd_cases()


@pytest.mark.extended  # make test has no time left: CI runs it in the extended lane
def test_two_dimensional_meshes_train_as_torchs_fsdp2_does():
    run_distributed(_two_dimensional_cases, 4, timeout=600)
