"""What ``fully_shard`` makes of a module, as torch's FSDP2 tests check it
(test_fully_shard_state.py), in our own words:

- ``fully_shard.state(module)`` returns the unit's state object, a distinct one per
  ``fully_shard`` call, and None for a module it was never applied to;
- a second ``fully_shard`` on one module raises ``AssertionError`` with torch's words;
- only the module passed in changes class (``FSDP<Class>``, still an instance of its
  own class and of ``FSDPModule``); its children and a slice of a sharded
  ``nn.Sequential`` are plain;
- a container without ``forward`` (``ModuleList``, ``ModuleDict``) is refused with
  ``ValueError`` and torch's words;
- ``copy.deepcopy`` of a sharded module raises ``AssertionError`` with torch's words.

torch runs these on one rank of its threaded process group; so does this file (no
process to spawn).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch.nn as nn

from fullshard import FSDPModule, fully_shard
from fullshard.testing.threaded_world import run_threaded


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _raises(fn, kind: type, pattern: str) -> None:
    with pytest.raises(kind) as info:
        fn()
    assert re.search(pattern, str(info.value)), str(info.value)


def _one_state_per_call() -> None:
    model = nn.Sequential(*[_mlp() for _ in range(3)])
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    states = [fully_shard.state(m) for m in (model, *model)]
    assert all(s is not None for s in states)
    assert len({id(s) for s in states}) == len(states)
    assert fully_shard.state(model[0][0]) is None  # a child the call did not name


def _applied_once() -> None:
    model = fully_shard(_mlp())
    _raises(lambda: fully_shard(model), AssertionError,
            "Each distinct composable distributed API can only be applied to a module once")


def _only_the_given_module_changes_class() -> None:
    model = fully_shard(_mlp())
    assert isinstance(model, nn.Sequential) and isinstance(model, FSDPModule)
    assert type(model).__name__ == "FSDPSequential"
    assert not any(isinstance(m, FSDPModule) for m in model.modules() if m is not model)
    head = model[:2]  # Sequential slicing builds a new container of the same class
    assert isinstance(head, nn.Sequential) and not isinstance(head, FSDPModule)


def _containers_without_forward_refused() -> None:
    words = r"fully_shard does not support containers that do not implement forward"
    _raises(lambda: fully_shard(nn.ModuleList([_mlp() for _ in range(2)])), ValueError, words)
    _raises(lambda: fully_shard(nn.ModuleDict({"a": _mlp(), "b": _mlp()})), ValueError, words)


def _no_deepcopy() -> None:
    model = fully_shard(_mlp())
    _raises(lambda: copy.deepcopy(model), AssertionError, "FSDP does not support deepcopy")


def _all_cases() -> None:
    _one_state_per_call()
    _applied_once()
    _only_the_given_module_changes_class()
    _containers_without_forward_refused()
    _no_deepcopy()


def test_what_fully_shard_makes_of_a_module_is_torchs():
    run_threaded(_all_cases, 1)
