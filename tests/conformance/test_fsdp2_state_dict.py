"""The state-dict behaviours torch's FSDP2 state-dict tests check, run on CPU/gloo.

``model.state_dict()`` of a sharded model gives DTensors that alias the sharded
parameters (no copy), under 1-D, hybrid (2-D) and dp x tp meshes, with dims that do
not divide by the world (ranks holding padding only) and with a shard placement on the
largest dim; loading DTensors with other storages writes into the parameters in place;
a forward that keeps parameters whole does not change what ``state_dict()`` returns; a
state dict taken once stays the parameters' storage through optimizer steps; a meta
model under CPU offload loads its shards piecewise with ``assign=True, strict=False``
and trains; a dp x tp state dict equals the unsharded model's; rank 0 alone can build a
full CPU state dict from the sharded one. All cases run in one four-rank launch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from fullshard import CPUOffloadPolicy, fully_shard
from fullshard.testing import run_distributed

WORLD = 4


class _MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.in_proj = nn.Linear(dim, 4 * dim)
        self.out_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def _nested(dim: int) -> nn.Module:
    torch.manual_seed(42)
    return nn.Sequential(_MLP(dim), nn.Sequential(_MLP(dim), nn.Linear(dim, dim)), _MLP(dim))


def _on_largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.ndim), key=lambda d: param.shape[d]))


def _shard_each_then_root(model: nn.Module, **kwargs) -> nn.Module:
    for module in model:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _save_load_in_place(model: nn.Module, what: str) -> None:
    """state_dict() aliases the sharded parameters; load_state_dict() of new DTensors
    writes their values into the same parameters."""
    names = [n for n, _ in model.named_parameters()]
    assert all(isinstance(p, DTensor) for p in model.parameters()), what
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    sizes = [p.size() for p in model.parameters()]
    sd = model.state_dict()
    assert [p.size() for p in model.parameters()] == sizes, what
    assert all(isinstance(p, nn.Parameter) for p in model.parameters()), what
    assert set(sd) == set(names), (what, set(sd) ^ set(names))
    for name, value in sd.items():
        assert isinstance(value, DTensor), (what, name)
        if ptrs[name] == 0:  # this rank holds padding only
            assert value.to_local().count_nonzero() == 0, (what, name)
        else:
            assert value.to_local().data_ptr() == ptrs[name], f"{what}: {name} was copied"
    new_value = 42.0 + dist.get_rank()
    model.load_state_dict({n: v.detach().clone().fill_(new_value) for n, v in sd.items()})
    for name, p in model.named_parameters():
        local = p.to_local()
        assert torch.all(local == new_value), (what, name)
        if local.size(0) * p.device_mesh.size() == p.size(0):  # evenly sharded: in place
            assert local.data_ptr() == ptrs[name], f"{what}: {name} moved on load"


def _dp_save_load(mesh, dims, placement=None) -> None:
    for dim in dims:
        shard = {"mesh": mesh, "shard_placement_fn": placement}
        what = f"dim {dim}, mesh {tuple(mesh.shape)}, placement {placement is not None}"
        _save_load_in_place(_shard_each_then_root(_nested(dim), **shard), what)
        kept = _shard_each_then_root(_nested(dim), reshard_after_forward=False, **shard)
        _save_load_in_place(kept, what + ", kept whole")
        before = {k: v.full_tensor() for k, v in kept.state_dict().items()}
        kept(torch.randn(2, dim))  # the parameters stay whole after this forward
        after = kept.state_dict()
        assert set(after) == set(before), what
        for key, value in after.items():
            assert isinstance(value, DTensor), (what, key)
            torch.testing.assert_close(value.full_tensor(), before[key])


def _taken_once_stays_the_storage() -> None:
    for dim in (2, 3, 4, 5):
        torch.manual_seed(42)
        model = fully_shard(nn.Linear(dim, dim, bias=False), reshard_after_forward=True)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sd = model.state_dict()

        def same() -> bool:
            return (sd["weight"].to_local().untyped_storage().data_ptr()
                    == model.weight.to_local().untyped_storage().data_ptr())
        assert same(), dim
        torch.manual_seed(42 + dist.get_rank())
        x = torch.rand(dim, dim)
        for _ in range(3):
            optim.zero_grad()
            model(x).sum().backward()
            optim.step()
            assert same(), f"dim {dim}: the state dict no longer aliases the weight"


def _meta_offload_loads_piecewise() -> None:
    for pin in (True, False):
        policy = CPUOffloadPolicy(pin_memory=pin)
        torch.manual_seed(42)
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        _shard_each_then_root(model, offload_policy=policy)
        for name, p in model.named_parameters():
            shard = distribute_tensor(torch.randn(p.size()), p.device_mesh, p.placements)
            model.load_state_dict({name: shard}, assign=True, strict=False)
        model(torch.rand(4, 4)).sum().backward()
        assert all(v.device.type == "cpu" for v in model.state_dict().values())


def _tp_plan() -> dict:
    return {f"{i}.{proj}": style() for i in range(3)
            for proj, style in (("in_proj", ColwiseParallel), ("out_proj", RowwiseParallel))}


def _dp_tp() -> None:
    world = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    for dim in (4, 6):
        torch.manual_seed(42)
        plain = nn.Sequential(*[_MLP(dim) for _ in range(3)])
        model = parallelize_module(copy.deepcopy(plain), world["tp"], _tp_plan())
        _shard_each_then_root(model, mesh=world["dp"])
        for (key, ref), (key2, value) in zip(plain.state_dict().items(),
                                             model.state_dict().items()):
            assert key == key2 and isinstance(value, DTensor), (key, key2)
            torch.testing.assert_close(value.full_tensor(), ref)
        _save_load_in_place(model, f"dp x tp, dim {dim}")


def _rank0_full_cpu_state_dict() -> None:
    torch.manual_seed(42)
    reference = nn.Sequential(*[_MLP(8) for _ in range(2)])
    model = _shard_each_then_root(copy.deepcopy(reference))
    full = {}
    for key, value in model.state_dict().items():
        whole = value.full_tensor()  # a collective: every rank takes part
        if dist.get_rank() == 0:
            full[key] = whole.cpu()
    if dist.get_rank() == 0:
        assert list(full) == list(reference.state_dict())
        for key, ref in reference.state_dict().items():
            assert full[key].device.type == "cpu"
            torch.testing.assert_close(full[key], ref)
    else:
        assert not full


def _all_cases() -> None:
    flat = init_device_mesh("cpu", (WORLD,))
    hybrid = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for mesh in (flat, hybrid):
        _dp_save_load(mesh, (2, 3, 4, 5))
        _dp_save_load(mesh, (16,), _on_largest_dim)
    _taken_once_stays_the_storage()
    _meta_offload_loads_piecewise()
    _dp_tp()
    _rank0_full_cpu_state_dict()


@pytest.mark.slow
def test_state_dicts_alias_load_in_place_and_match_torchs():
    run_distributed(_all_cases, WORLD, timeout=300)
