"""What a root's sharded model looks like, as ranks compare it at its first forward.

Note [ranks shard the same model]
Every rank of a mesh must shard the same model: the k-th all-gather of one rank meets
the k-th of every other, so a model that differs on one rank (a config read from a
different file, another vocabulary size, one more layer, a model left in float64) pairs
collectives of different sizes. gloo then aborts inside its transport ("Read error ...
Connection reset by peer") on the rank that notices first, and the other rank's message
names only where it failed; NCCL may hang or, where sizes happen to match, mix data.
The divergence guard (core/guard/divergence.py) cannot help: it compares what ranks *ran*,
after the collectives that already broke.

So at lazy init, before the root's first collective, each rank describes its units in
order (name, parameters with their global shapes, dtypes and placements, the mixed
precision and resharding that set collective sizes and counts), hashes the description
to 63 bits and the ranks all-reduce (MAX) the digest and its negative on the control
channel (core/guard/control.py): one exchange of two integers per root, whatever the world
size, and every rank learns whether all were equal. Only when they were not do the
ranks exchange more: every rank's digest (8 bytes each), then one description per
distinct digest, broadcast by the lowest rank holding it, so that every rank names the
same first difference and raises the same error. Nothing here runs where the guard
does not (one rank, torch's fake or threaded process groups).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

# At most this many distinct models are described in a message; ranks beyond them are
# named by their group only (a job where every rank differs needs no more detail).
MAX_DESCRIBED = 4


class ParamShape(NamedTuple):
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    placements: str
    requires_grad: bool

    def text(self) -> str:
        frozen = "" if self.requires_grad else ", frozen"
        return (f"'{self.fqn}' {self.dtype} {list(self.shape)} "
                f"({self.placements}{frozen})")


class UnitShape(NamedTuple):
    name: str
    mesh_shape: tuple[int, ...]
    param_dtype: str
    reduce_dtype: str
    reshard_after_forward: str
    params: tuple[ParamShape, ...]


def describe(units) -> tuple[UnitShape, ...]:
    """The parts of ``units`` (UnitState, in the root's order) that set which collectives
    run and their sizes."""
    out = []
    for unit in units:
        params = tuple(
            ParamShape(p.fqn, tuple(p.global_shape), _dtype(p.sharded_param.dtype),
                       ", ".join(repr(pl) for pl in p.placements),
                       bool(p.sharded_param.requires_grad))
            for p in unit.own_params)
        policy = unit.mp_policy
        out.append(UnitShape(unit.name, tuple(unit.mesh.mesh.shape),
                             _dtype(policy.param_dtype), _dtype(policy.reduce_dtype),
                             str(unit.reshard_after_forward), params))
    return tuple(out)


def digest(description: tuple[UnitShape, ...]) -> int:
    """63 bits of a description (non-negative, so that MAX over it and its negative tells
    whether every rank's was equal)."""
    raw = hashlib.blake2b(repr(description).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


def first_difference(a: tuple[UnitShape, ...], b: tuple[UnitShape, ...]) -> tuple[str, str]:
    """What ``a`` has and what ``b`` has at the first place they differ, as words."""
    for index, (ua, ub) in enumerate(zip(a, b)):
        if ua.name != ub.name:
            return (f"unit #{index} '{ua.name}'", f"unit #{index} '{ub.name}'")
        for pa, pb in zip(ua.params, ub.params):
            if pa != pb:
                return (f"parameter {pa.text()}", f"parameter {pb.text()}")
        if len(ua.params) != len(ub.params):
            return (_params_after(ua, len(ub.params)), _params_after(ub, len(ua.params)))
        for field, words in (("mesh_shape", "a mesh of shape"), ("param_dtype", "param_dtype"),
                             ("reduce_dtype", "reduce_dtype"),
                             ("reshard_after_forward", "reshard_after_forward")):
            if getattr(ua, field) != getattr(ub, field):
                return (f"unit '{ua.name}' with {words} {getattr(ua, field)}",
                        f"unit '{ub.name}' with {words} {getattr(ub, field)}")
    if len(a) != len(b):
        return (_units_after(a, len(b)), _units_after(b, len(a)))
    return ("the same units", "the same units")  # only a digest collision gets here


def message(root: str, groups: list[tuple[list[int], tuple[UnitShape, ...] | None]]) -> str:
    """The error every rank raises: ``groups`` are the ranks holding each distinct model
    (lowest rank first), with its description where it was exchanged."""
    reference_ranks, reference = groups[0]
    parts = []
    for ranks, other in groups[1:]:
        if other is None:
            parts.append(f"{_ranks(ranks)} sharded yet another model")
            continue
        mine, theirs = first_difference(reference, other)
        parts.append(f"{_ranks(reference_ranks)} {_have(reference_ranks)} {mine} where "
                     f"{_ranks(ranks)} {_have(ranks)} {theirs}")
    return (f"fullshard: the ranks sharded different models under root '{root}' (compared "
            f"before its first collective): {'; '.join(parts)}. Every rank must build and "
            "shard the same model (the same modules in the same order, with the same "
            "parameter names, shapes and dtypes): check that every rank reads the same "
            "config and casts the model the same way before fully_shard.")


def _params_after(unit: UnitShape, start: int) -> str:
    if start >= len(unit.params):
        return f"no parameter after {len(unit.params)} in unit '{unit.name}'"
    return f"parameter {unit.params[start].text()} in unit '{unit.name}'"


def _units_after(units: tuple[UnitShape, ...], start: int) -> str:
    if start >= len(units):
        return f"{len(units)} sharded units"
    return (f"{len(units)} sharded units (unit #{start} is '{units[start].name}')")


def _dtype(dtype) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"ranks {ranks[0]}, {ranks[1]}, ... ({len(ranks)} ranks)"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _have(ranks: list[int]) -> str:
    return "has" if len(ranks) == 1 else "have"
