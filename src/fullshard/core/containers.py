"""The tensors inside a unit's forward inputs and outputs, wherever they sit.

Note [dataclasses between units]
Models pass activations between units inside lists, dicts, namedtuples and also
dataclasses (a ``ModelOutput``-like record, a batch object). torch's pytree opens the
first three but takes an unregistered dataclass for a leaf, so its tensors were neither
cast to ``param_dtype`` nor hooked for the pre-backward gather: the backward then ran
on freed parameters ("setStorage: ... storage of size 0"). torch's FSDP2 opens
dataclasses too. ``flatten`` opens them (nested ones included) without registering
anything with pytree: registering a user's class is a process-wide change of what
pytree does for code that does not use fullshard. ``unflatten`` puts changed values
into a shallow copy of the record, set field by field, so a frozen dataclass or one
with ``init=False`` fields is rebuilt without calling its ``__init__``/``__post_init__``
again; a record none of whose values changed is returned as it came.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def _is_record(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def flatten(tree: Any) -> tuple[list, Any]:
    """The leaves of ``tree`` (pytree's, with dataclass instances opened) and what
    ``unflatten`` needs to rebuild it."""
    if type(tree) is torch.Tensor:  # the usual output: skip pytree
        return [tree], None
    leaves, spec = tree_flatten(tree, is_leaf=_is_record)
    flat: list = []
    records: list = []
    for leaf in leaves:
        if _is_record(leaf):
            names = [f.name for f in dataclasses.fields(leaf)]
            inner, inner_spec = flatten([getattr(leaf, n) for n in names])
            records.append((leaf, names, inner_spec, inner))
            flat.extend(inner)
        else:
            records.append(None)
            flat.append(leaf)
    return flat, (spec, records)


def unflatten(leaves: list, spec: Any) -> Any:
    """``tree`` of ``flatten(tree)`` with ``leaves`` in place of its leaves."""
    if spec is None:
        return leaves[0]
    tree_spec, records = spec
    out, at = [], 0
    for record in records:
        if record is None:
            out.append(leaves[at])
            at += 1
            continue
        original, names, inner_spec, inner = record
        mine = leaves[at:at + len(inner)]
        at += len(inner)
        if all(a is b for a, b in zip(mine, inner)):
            out.append(original)
        else:
            out.append(_with_values(original, names, unflatten(mine, inner_spec)))
    return tree_unflatten(out, tree_spec)


def _with_values(original: Any, names: list[str], values: list) -> Any:
    rebuilt = copy.copy(original)
    for name, value in zip(names, values):
        object.__setattr__(rebuilt, name, value)  # frozen records too (see the Note)
    return rebuilt
