"""``fully_shard(mesh=world_mesh, dp_mesh_dims=...)`` with several shard dimensions,
several replicate dimensions, or replicate dimensions alone, at four ranks (Note
[data-parallel dimensions of an SPMD mesh]): each parameter is what torch's own
``fully_shard`` makes of it (mesh, placements, local shard bit for bit), the model trains
as a single-process copy fed every rank's rows (AdamW), a state dict saved mid-run and
loaded in place continues as the run did, and what torch refuses is refused with torch's
exception type and words first."""

from __future__ import annotations

import copy
import inspect
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.utils._pytree import tree_map

from fullshard import DataParallelMeshDims, fully_shard
from fullshard.testing import run_distributed

CLOSE = {"rtol": 1e-5, "atol": 1e-6}
# torch before 2.13 has no dp_mesh_dims to compare with: there the placements are checked
# through training and the refusals alone
TORCH_TAKES_DP_MESH_DIMS = "dp_mesh_dims" in inspect.signature(torch_fully_shard).parameters
_names = itertools.count()  # torch keeps the first mesh a flattened name was made with


def _model() -> nn.Sequential:
    torch.manual_seed(7)  # 5 output rows: uneven over 4 ranks, the last one holds none
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 5))


def _shard(shard_fn, model: nn.Sequential, mesh, dims) -> nn.Sequential:
    distribute_module(model, mesh)
    for layer in (model[0], model[2]):
        shard_fn(layer, mesh=mesh, dp_mesh_dims=dims)
    shard_fn(model, mesh=mesh, dp_mesh_dims=dims)
    return model


def _rows(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _as_torch_does(mesh, dims, what: str) -> None:
    """Every parameter's mesh, placements and local shard are torch's, bit for bit."""
    ours = _shard(fully_shard, _model(), mesh, dims)
    theirs = _shard(torch_fully_shard, _model(), mesh, dims)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert isinstance(p, DTensor), (what, name)
        assert p.device_mesh.mesh_dim_names == q.device_mesh.mesh_dim_names, (what, name)
        assert p.device_mesh.mesh.tolist() == q.device_mesh.mesh.tolist(), (what, name)
        assert p.placements == q.placements, (what, name, p.placements, q.placements)
        assert torch.equal(p.to_local(), q.to_local()), (what, name)


def _step(model, optim, mesh, step: int) -> torch.Tensor:
    x = DTensor.from_local(_rows(step, dist.get_rank()), mesh, [Replicate()] * mesh.ndim,
                           run_check=False)  # each rank its own rows
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.to_local().detach()


def _trains_as_one_process(mesh, dims, what: str) -> None:
    """Losses, gradients and weights of AdamW steps are a single process's on every
    rank's rows; a state dict saved after two steps, loaded in place, trains on alike."""
    reference = _model()
    model = _shard(fully_shard, copy.deepcopy(reference), mesh, dims)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    world = dist.get_world_size()
    saved, losses = None, []
    for step in range(4):
        x = DTensor.from_local(_rows(step, dist.get_rank()), mesh,
                               [Replicate()] * mesh.ndim, run_check=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        everyone = torch.cat([_rows(step, r) for r in range(world)])
        ref_loss = reference(everyone).pow(2).mean()
        ref_loss.backward()
        mean = loss.to_local().detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), **CLOSE,
                                   msg=lambda e: f"{what}, loss {step}: {e}")
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad, **CLOSE,
                                       msg=lambda e, n=name: f"{what}, grad {n} {step}: {e}")
            assert p.grad.placements == p.placements, (what, name, p.grad.placements)
        optim.step()
        optim.zero_grad()
        ref_optim.step()
        ref_optim.zero_grad()
        if step == 1:
            saved = _cloned((model.state_dict(), optim.state_dict()))
        elif step > 1:
            losses.append(loss.to_local().detach())
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), ref, **CLOSE,
                                   msg=lambda e, n=name: f"{what}, weight {n}: {e}")
    model.load_state_dict(saved[0])
    optim.load_state_dict(saved[1])
    again = [_step(model, optim, mesh, step) for step in (2, 3)]
    for step, (a, b) in enumerate(zip(again, losses), 2):
        assert torch.equal(a, b), f"{what}: after loading, loss {step} {a} != {b}"


def _cloned(state):
    """A copy of nested state dicts, every tensor cloned (the live ones change on)."""
    return tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, state)


def _case(sizes, names, **dims) -> tuple:
    """A mesh whose dimension names no other case used, and dims naming them."""
    k = next(_names)
    names = tuple(f"{n}{k}" for n in names)
    renamed = {key: tuple(f"{n}{k}" for n in v) if isinstance(v, tuple) else f"{v}{k}"
               for key, v in dims.items()}
    return init_device_mesh("cpu", sizes, mesh_dim_names=names), DataParallelMeshDims(**renamed)


# (sizes, names, dims, whether every rank is a data-parallel one and so trains on rows
# of its own); "t" is a model-parallel dimension
_CASES = (((2, 2), ("a", "b"), {"shard": ("a", "b")}, True),
          ((2, 2), ("a", "b"), {"replicate": ("a", "b")}, True),
          ((2, 1, 2), ("r", "t", "s"), {"shard": "s", "replicate": "r"}, True),
          ((1, 2, 2), ("r", "a", "b"), {"shard": ("a", "b"), "replicate": "r"}, True),
          ((2, 2, 1), ("a", "b", "t"), {"shard": ("a", "b")}, True),
          ((2, 2), ("s", "r"), {"shard": "s", "replicate": "r"}, True),
          ((2, 1, 2), ("a", "t", "b"), {"replicate": ("a", "b")}, True),
          ((2, 2), ("a", "t"), {"replicate": "a"}, False))


def _refused(mesh, dims, kind: type, words: str) -> None:
    model = nn.Linear(4, 4)
    distribute_module(model, mesh)
    with pytest.raises(kind, match=words):
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)


def _refusals() -> None:
    """What torch refuses, refused with torch's exception type and words first."""
    _refused(*_case((2, 2), ("a", "b"), shard=("b", "a")), KeyError,
             r"Invalid mesh_dim_names .* ascending order\. fully_shard\(Linear\)")
    _refused(*_case((2, 2), ("a", "b"), shard="a", replicate="a"), RuntimeError,
             r"Cannot concatenate overlapping meshes")
    _refused(*_case((2, 1, 2), ("a", "r", "b"), shard=("a", "b"), replicate="r"),
             RuntimeError, r"Cannot concatenate overlapping meshes")
    _refused(*_case((2, 2), ("a", "b"), shard=("a", "a")), RuntimeError,
             r"Slicing overlapping dim_names")
    _refused(*_case((2, 2), ("a", "b"), shard=()), RuntimeError,
             r"Cannot flatten a DeviceMesh without mesh_dim_names!")


def _all_cases() -> None:
    for sizes, names, dims, trains in _CASES:
        mesh, dp = _case(sizes, names, **dims)
        what = f"{dp} on {mesh}"
        if TORCH_TAKES_DP_MESH_DIMS:
            _as_torch_does(mesh, dp, what)
        if trains:
            _trains_as_one_process(mesh, dp, what)
    _refusals()


@pytest.mark.slow
def test_every_data_parallel_mesh_torch_takes_shards_and_trains_as_torch_does():
    run_distributed(_all_cases, 4, timeout=600)
