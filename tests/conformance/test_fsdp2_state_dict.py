"""The module state dict of sharded models, as torch's FSDP2 tests check it
(test_fully_shard_state_dict.py, the data-parallel cases), in our own words: its values
are DTensors that share storage with the sharded parameters; loading DTensors with other
storages writes into the parameters in place; a state dict taken while a unit keeps its
parameters gathered (reshard_after_forward=False, after a forward) is the sharded one;
and a state dict taken once keeps following the parameters through optimizer steps.
Widths that divide and do not divide the two ranks; one launch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from fullshard.testing import run_distributed


def _mlp(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))


def _model(width: int) -> nn.Sequential:
    return nn.Sequential(_mlp(width), nn.Sequential(_mlp(width), nn.Linear(width, width)),
                         _mlp(width))


def _shard(model: nn.Sequential, **kwargs) -> nn.Sequential:
    for child in model:
        fully_shard(child, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _local_ptr(t: DTensor) -> int:
    return t.to_local().data_ptr()


def _save_load(model: nn.Module, what: str) -> None:
    """The state dict shares the parameters' storage; loading other DTensors writes in
    place (same storage where the shard has no padding)."""
    rank = dist.get_rank()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    ptrs = {n: _local_ptr(p) for n, p in model.named_parameters()}
    sizes = [p.size() for p in model.parameters()]
    sd = model.state_dict()
    assert [p.size() for p in model.parameters()] == sizes, what
    assert set(sd) == set(ptrs), (what, set(sd) ^ set(ptrs))
    for name, value in sd.items():
        assert isinstance(value, DTensor), (what, name, type(value))
        if value.to_local().numel() == 0:
            continue  # an empty shard (a dim smaller than the ranks): nothing to share
        assert _local_ptr(value) == ptrs[name], (what, name)
    new = {n: v.detach().clone().fill_(42.0 + rank) for n, v in sd.items()}
    model.load_state_dict(new)
    for name, p in model.named_parameters():
        local = p.to_local()
        assert torch.equal(local, torch.full_like(local, 42.0 + rank)), (what, name)
        if local.numel() and local.size(0) * p.device_mesh.size() == p.size(0):
            assert local.data_ptr() == ptrs[name], (what, name)


def _after_forward_is_sharded(width: int) -> None:
    torch.manual_seed(0)
    model = _shard(_model(width), reshard_after_forward=False)
    before = {k: v.full_tensor() for k, v in model.state_dict().items()}
    model(torch.randn(2, width))  # the units keep their parameters gathered now
    after = model.state_dict()
    assert set(after) == set(before)
    for key, value in after.items():
        assert isinstance(value, DTensor), (key, type(value))
        assert torch.equal(value.full_tensor(), before[key]), key


def _state_dict_follows_training() -> None:
    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 4, bias=False))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = model.state_dict()  # taken once, read later (torch's callers cache it)
    for step in range(3):
        optim.zero_grad()
        model(torch.rand(4, 4)).sum().backward()
        optim.step()
        assert _local_ptr(sd["weight"]) == _local_ptr(model.weight), step
        assert torch.equal(sd["weight"].to_local(), model.weight.to_local()), step


def _all_cases() -> None:
    for width in (2, 3, 4, 5):
        torch.manual_seed(0)
        base = _model(width)
        _save_load(_shard(copy.deepcopy(base)), f"width {width}")
        _save_load(_shard(copy.deepcopy(base), reshard_after_forward=False),
                   f"width {width}, reshard_after_forward=False")
        _after_forward_is_sharded(width)
    _state_dict_follows_training()


def test_state_dicts_of_sharded_models_behave_as_torchs_fsdp2():
    run_distributed(_all_cases, 2)
