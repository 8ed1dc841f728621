"""The ledger: what one rank did, in order, for the units of one root.

Every unit forward and every collective fullshard issues for a root's units is one
entry: (step, phase, operation, unit, elements). Entries fold into a running digest, so
two ranks that did the same things have the same (count, digest) and comparing two
integers compares everything; the entries since the ranks last agreed are kept, so when
they do not, the first difference can be named (core/guard/divergence.py). Recording is host
arithmetic on small integers: nothing is sent and nothing waits.

Entries hold integers only (a unit is the CRC-32 of its path from the root, the same on
every rank whatever modules each has; operations are codes), never strings: Python hashes
integers the same way in every process, strings not.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

# Operations. FORWARD is a unit's forward starting (no collective): recorded so that a
# unit skipped on one rank is named even when prefetching kept the gathers in step.
# STALE_GATHER is a gather that parameters kept gathered across backward needed because
# this rank's shard was written in place since: named, because a write on some ranks only
# makes those ranks gather alone.
# OWN_GROUP_REDUCE is a reduce-scatter on a group of its own (Note [a reduce-scatter group
# of its own] in core/comm_groups.py): ranks that disagree on that are named, not hung.
FORWARD, ALL_GATHER, POST_FORWARD_GATHER, SUBCLASS_GATHER, REDUCE_SCATTER, ALL_REDUCE, \
    STALE_GATHER, OWN_GROUP_REDUCE = range(8)
GATHER_AGAIN = "all-gather again"
REDUCE_SCATTER_OWN_GROUP = "reduce-scatter on its own process group"
OPERATIONS = {
    "all-gather": ALL_GATHER,
    GATHER_AGAIN: STALE_GATHER,
    "all-gather (post-forward subgroup)": POST_FORWARD_GATHER,
    "all-gather (tensor-subclass parameters)": SUBCLASS_GATHER,
    "reduce-scatter": REDUCE_SCATTER,
    REDUCE_SCATTER_OWN_GROUP: OWN_GROUP_REDUCE,
    "all-reduce": ALL_REDUCE,
}
_OPERATION_NAMES = {code: name for name, code in OPERATIONS.items()}

# The digest as it travels in a reduction's chunk (Note [a reduction's chunk] in
# core/gradients.py): this many elements of 8 bits each, exact in any floating dtype.
DIGEST_NUMEL = 8


def digest_elements(digest: int) -> list[int]:
    """A 64-bit digest as DIGEST_NUMEL values of 8 bits each."""
    return [(digest >> (8 * i)) & 0xFF for i in range(DIGEST_NUMEL)]
_OPERATION_NAMES[FORWARD] = "forward"

# Phases: where the rank was when it recorded the entry.
FORWARD_WITH_GRAD, FORWARD_WITHOUT_GRAD, BACKWARD, BETWEEN_STEPS = range(4)
PHASE_NAMES = ("forward", "forward without grad", "backward",
               "outside forward and backward")

_MODULUS = (1 << 61) - 1  # a prime: the digest is a polynomial hash of the entries
_BASE = 1_000_003
# Entries kept for naming a difference; a phase with more (a forward of thousands of
# units) is still compared by digest, but only its last entries can be named.
HISTORY = 8192


class Entry(NamedTuple):
    step: int
    phase: int
    operation: int
    unit: int
    numel: int


def unit_code(name: str) -> int:
    """A unit's identity in entries: the same on every rank for the same path."""
    return zlib.crc32(name.encode())


class Ledger:
    """One rank's record for one root (see the module docstring)."""

    def __init__(self, unit_names: list[str]):
        self.unit_names = {unit_code(name): name for name in unit_names}
        self.step = -1     # the root's forward now running, counted from 0 ("step" in messages)
        self.count = 0     # entries recorded so far
        self.digest = 0
        self.agreed = 0    # ``count`` when the ranks last agreed
        # since ``agreed``: count -> (digest after it, entry); bounded by HISTORY
        self.entries: dict[int, tuple[int, Entry]] = {}

    def record(self, phase: int, operation: int, unit: int, numel: int = 0) -> None:
        # a plain tuple (made an Entry only to be named): this runs for every unit forward
        entry = (self.step, phase, operation, unit, numel)
        count = self.count = self.count + 1
        digest = self.digest = (self.digest * _BASE + (hash(entry) & _MODULUS)) % _MODULUS
        entries = self.entries
        entries[count] = (digest, entry)
        if count - self.agreed > HISTORY:
            entries.pop(count - HISTORY, None)

    def mark_agreed(self, count: int | None = None) -> None:
        """Every rank did the same up to entry ``count`` (default: all so far)."""
        count = self.count if count is None else count
        if count <= self.agreed:
            return
        self.agreed = count
        for kept in [c for c in self.entries if c <= count]:
            del self.entries[kept]

    def describe(self, entry: tuple, names: dict[int, str] | None = None) -> str:
        """``entry`` in words; ``names`` adds other ranks' units to this rank's."""
        entry = Entry(*entry)
        unit = self.unit_names.get(entry.unit) or (names or {}).get(entry.unit) \
            or f"unit {entry.unit:#x}"
        if entry.operation == FORWARD:
            return f"the forward of '{unit}'"
        return f"the {_OPERATION_NAMES[entry.operation]} of '{unit}'"
