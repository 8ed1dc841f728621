"""The parameters ``fully_shard`` replaced, and which unit replaced them.

After sharding, a module holds DTensors; the original ``nn.Parameter`` objects are
dead unless something else still holds them: another module (a parameter shared
across units), or an optimizer built before ``fully_shard`` (it would update tensors
the model no longer uses). Both are errors, and this registry names the unit.
"""

from __future__ import annotations

import weakref

import torch.nn as nn


class OriginalOwners:
    """Original (pre-shard) parameter -> label of the unit that sharded it. A parameter
    object another module still holds after its unit replaced it with a DTensor is
    shared across units (see api._collect_params). Keyed by id with weak references:
    tensors cannot be WeakKeyDictionary keys (their == is elementwise)."""

    def __init__(self):
        self._owners: dict[int, tuple[weakref.ref, str]] = {}

    def add(self, param: nn.Parameter, label: str) -> None:
        key = id(param)
        self._owners[key] = (weakref.ref(param, lambda _r: self._owners.pop(key, None)), label)

    def get(self, param: nn.Parameter) -> str | None:
        entry = self._owners.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None


SHARDED_ORIGINALS = OriginalOwners()
