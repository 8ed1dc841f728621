"""Which tensors are fullshard's: the sharded parameters it made, and the ones it replaced.

Both are process-wide because the questions come from places that hold no unit: an
optimizer's step hook sees only tensors (optim.py), and ``fully_shard`` must recognise
a parameter another unit already replaced. Entries are keyed by ``id`` with weak
references: tensors cannot be ``WeakKeyDictionary`` keys (their ``==`` is elementwise),
and ``swap_tensors`` (used by ``Module._apply``) refuses tensors that are weakly
referenced, so the weak reference goes to the owner (a ShardedParam), never the tensor.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn as nn


class _Tracked(NamedTuple):
    owner: weakref.ref  # the ShardedParam that holds this DTensor as its sharded_param
    spec: object        # the DTensor's spec when tracked: tells a stale parameter apart


# id(sharded DTensor parameter) -> _Tracked. An entry outlives its parameter when
# something replaces the parameter (a load with assign=True): an optimizer still holding
# the old object is caught by stale_owner(), which compares the spec to tell the old
# object from a new tensor that happens to reuse its id.
_SHARDED: dict[int, _Tracked] = {}


# Called once, when the first sharded parameter is tracked: what must be installed
# process-wide for fullshard's parameters (the optimizer step hooks of optim.py) is
# installed then, by the first fully_shard, never by importing fullshard.
_ON_FIRST_TRACK: list = []


def on_first_track(install) -> None:
    """Run ``install()`` when the first sharded parameter is tracked (at once if one is)."""
    if _installed:
        install()
    else:
        _ON_FIRST_TRACK.append(install)


_installed = False


def track(owner) -> None:
    """Register ``owner.sharded_param`` (a ShardedParam's DTensor) for as long as
    ``owner`` lives."""
    global _installed
    if not _installed:
        _installed = True
        for install in _ON_FIRST_TRACK:
            install()
        _ON_FIRST_TRACK.clear()
    key = id(owner.sharded_param)

    def forget(ref: weakref.ref) -> None:
        entry = _SHARDED.get(key)
        if entry is not None and entry.owner is ref:
            del _SHARDED[key]

    _SHARDED[key] = _Tracked(weakref.ref(owner, forget), owner.sharded_param._spec)


def any_tracked() -> bool:
    """Whether this process holds any fullshard sharded parameter at all."""
    return bool(_SHARDED)


def owner_of(t: torch.Tensor):
    """The live ShardedParam whose current sharded parameter is ``t``, else None."""
    entry = _SHARDED.get(id(t))
    owner = entry.owner() if entry is not None else None
    return owner if owner is not None and owner.sharded_param is t else None


def stale_owner(t: torch.Tensor):
    """The ShardedParam that ``t`` *was* the sharded parameter of before something
    replaced it (the same object, judged by its spec), else None."""
    entry = _SHARDED.get(id(t))
    owner = entry.owner() if entry is not None else None
    if owner is None or owner.sharded_param is t or getattr(t, "_spec", None) is not entry.spec:
        return None
    return owner


def is_sharded_param(t: torch.Tensor) -> bool:
    """Whether ``t`` is a sharded parameter some fullshard unit registered (and holds)."""
    return owner_of(t) is not None


class OriginalOwners:
    """Original (pre-shard) parameter -> label of the unit that sharded it.

    After sharding, a module holds DTensors; the original ``nn.Parameter`` objects are
    dead unless something else still holds them: another module (a parameter shared
    across units), or an optimizer built before ``fully_shard`` (it would update
    tensors the model no longer uses). Both are errors, and this names the unit."""

    def __init__(self):
        self._owners: dict[int, tuple[weakref.ref, str]] = {}

    def add(self, param: nn.Parameter, label: str) -> None:
        key = id(param)
        self._owners[key] = (weakref.ref(param, lambda _r: self._owners.pop(key, None)), label)

    def get(self, param: nn.Parameter) -> str | None:
        entry = self._owners.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None


SHARDED_ORIGINALS = OriginalOwners()
