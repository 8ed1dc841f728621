"""fullshard on torch's threaded process group (every rank a thread of one process), the
group torch's own FSDP2 tests run on: which tensors a module has registered as its
parameters after forward, after ``reshard()`` and after backward.

What torch promises: a unit's registered parameters are sharded DTensors except between
a forward that did not reshard and the next reshard, when they are plain tensors holding
the whole values.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard import FSDPModule, fully_shard
from fullshard.testing.threaded_world import run_threaded

WORLD = 4  # an integer reshard_after_forward of 2 makes subgroups of 2 ranks of 4
SETTINGS = (True, False, 2, None)


class _TwoLayers(nn.Module):
    def __init__(self, width: int = 6):
        super().__init__()
        self.first = nn.Linear(width, 3 * width)
        self.second = nn.Linear(3 * width, width)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _same_start(model: nn.Module) -> nn.Module:
    """Rank 0's values on every rank: the ranks share one random generator, so each
    thread's model starts different."""
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=0)
    return model


def _kinds(params) -> list[str]:
    return ["dtensor" if isinstance(p, DTensor) else "tensor" for p in params]


def _differs(model: nn.Module, ref: nn.Module) -> float:
    worst = 0.0
    for param, ref_param in zip(model.parameters(), ref.parameters()):
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        worst = max(worst, (whole.detach() - ref_param).abs().max().item())
    return worst


def _shard(model: _TwoLayers, nested: bool, setting) -> None:
    """Shard ``model``, its first layer a unit of its own when ``nested``."""
    if nested:
        fully_shard(model.first, reshard_after_forward=setting)
    fully_shard(model, reshard_after_forward=setting)
    # one collective per unit, as torch: merged into the root's group, a small unit
    # would follow the root's rule (docs/conformance.md, buckets)
    model.set_bucket_numel(0)


def _registered(model: _TwoLayers, nested: bool) -> tuple[list, list]:
    """The parameters registered now on the root unit and on the inner unit (read again
    each time: sharding and gathering swap the registered tensors)."""
    if nested:
        return list(model.second.parameters()), list(model.first.parameters())
    return list(model.parameters()), []


def _after_forward() -> dict:
    """{(nested, setting): (kinds after forward of the root's then the inner units'
    parameters, kinds after reshard, largest difference from the unsharded copy)}."""
    seen = {}
    for nested in (False, True):
        for setting in SETTINGS:
            torch.manual_seed(0)
            model = _same_start(_TwoLayers())
            ref = copy.deepcopy(model)
            _shard(model, nested, setting)
            model(torch.randn(2, 6))
            root, inner = _registered(model, nested)
            after = (_kinds(root), _kinds(inner))
            worst = _differs(model, ref)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            worst = max(worst, _differs(model, ref))
            seen[(nested, setting)] = (after, _kinds(model.parameters()), worst)
    return seen


def _after_backward() -> dict:
    """{(nested, setting): kinds of the registered parameters after backward}."""
    seen = {}
    for nested in (False, True):
        for setting in SETTINGS:
            model = _TwoLayers()
            _shard(model, nested, setting)
            model(torch.randn(2, 6)).sum().backward()
            seen[(nested, setting)] = _kinds(model.parameters())
    return seen


def _expected_after_forward(nested: bool, setting) -> tuple[list, list]:
    # None: the root keeps its parameters whole (backward starts with it), other
    # units free them; an integer keeps a slice, which is no registered parameter
    root_whole = setting is False or setting is None
    inner_whole = setting is False
    root = ["tensor" if root_whole else "dtensor"] * (2 if nested else 4)
    inner = ["tensor" if inner_whole else "dtensor"] * (2 if nested else 0)
    return root, inner


@pytest.mark.slow
def test_registered_parameters_after_forward_and_reshard():
    seen = run_threaded(_after_forward, WORLD)
    for rank in range(WORLD):
        for (nested, setting), (after, after_reshard, worst) in seen[rank].items():
            assert after == _expected_after_forward(nested, setting), (rank, nested, setting)
            assert after_reshard == ["dtensor"] * 4, (rank, nested, setting)
            assert worst == 0.0, (rank, nested, setting)


@pytest.mark.slow
def test_registered_parameters_after_backward_are_sharded():
    seen = run_threaded(_after_backward, WORLD)
    for rank in range(WORLD):
        for key, kinds in seen[rank].items():
            assert kinds == ["dtensor"] * 4, (rank, key)


@pytest.mark.slow
def test_a_second_threaded_world_in_one_process():
    # torch's threaded tests make a new world per test in one process: what fullshard
    # set up in the first (its reshard_after_forward=2 subgroups) must not leak into it
    for _ in range(2):
        seen = run_threaded(_after_backward, WORLD)
        assert seen[0][(True, 2)] == ["dtensor"] * 4


def _default_buckets_after_forward() -> dict:
    """{setting: kinds of the inner unit's registered parameters after forward}, the
    inner unit left to fullshard's default bucketing (small units merge into the root's
    all-gather group)."""
    seen = {}
    for setting in (None, True):
        model = _TwoLayers()
        fully_shard(model.first, reshard_after_forward=setting)
        fully_shard(model, reshard_after_forward=setting)
        model(torch.randn(2, 6))
        seen[setting] = _kinds(model.first.parameters())
    return seen


@pytest.mark.slow
def test_a_small_unit_merged_into_the_root_follows_the_roots_rule():
    """The deliberate difference from torch's test_param_registration_after_forward
    (docs/conformance.md): with the default reshard_after_forward=None, a small inner
    unit merged into the root's group stays whole after forward, as the root does, where
    torch frees it; with True both free their parameters, as in torch."""
    seen = run_threaded(_default_buckets_after_forward, 2)
    for rank in range(2):
        assert seen[rank] == {None: ["tensor"] * 2, True: ["dtensor"] * 2}, (rank, seen[rank])
