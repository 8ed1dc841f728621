"""What ranks exchange when their digests differ, and the first difference named.

The divergence guard (core/guard/divergence.py) compares ranks by a few integers; only when
those differ (or a rank is stalled) do the ranks exchange their records: each rank's
entries since the ranks last agreed (core/guard/ledger.py). ``first_difference`` reads only the
exchanged records, so every rank finds the same difference and raises the same error.
"""

from __future__ import annotations

from typing import NamedTuple

from .ledger import PHASE_NAMES, Entry

# Record kinds: a rank at a check (end of a phase, or before a collective in debug mode),
# a rank stalled inside a collective, or a rank at another model's check showing its
# record of the model a peer is stalled in (Note [models sharing the guard's exchange]).
CHECK, STALLED, ELSEWHERE = 0, 1, 2


class Record(NamedTuple):
    """One rank's record of one model, as exchanged."""
    kind: int
    phase: int
    count: int
    agreed: int
    entries: dict[int, tuple[int, Entry]]
    names: dict[int, str]  # this rank's units, to name entries other ranks do not have
    serial: int            # the guard's (Note [models sharing the guard's exchange])


class Difference(NamedTuple):
    count: int          # the first entry where the ranks differ
    step: int
    phase: str
    what: list[str]     # per rank: what it did there


def first_difference(records: list[Record], describe) -> Difference | None:
    """The first entry where the ranks' records disagree, or None when they are
    consistent (equal, or stalled ranks behind the others). The same on every rank: it
    reads only the exchanged records. ``describe(entry)`` names an entry.

    Where the records start: a rank's ``agreed`` is where a comparison showed every rank
    equal, so the furthest of them holds for all (a rank that vouched for entry #6 in a
    reduction's digests may already have dropped it, while a rank that was stalled since
    still keeps it)."""
    agreed = max(r.agreed for r in records)
    last = max(r.count for r in records)
    for count in range(agreed + 1, last + 1):
        behind = [r for r in records if r.count < count]
        if behind:
            if all(r.kind == STALLED for r in behind):
                return None  # the ranks behind are still inside the phase: consistent
            return _difference(records, count, describe)
        if len({_digest_at(r, count) for r in records}) > 1:
            return _difference(records, count, describe)
    if len({r.phase for r in records if r.kind == CHECK}) > 1:  # same entries, other checks
        return _difference(records, last + 1, describe)
    return None


def _digest_at(record: Record, count: int) -> int | None:
    kept = record.entries.get(count)
    return kept[0] if kept is not None else None


def _difference(records: list[Record], count: int, describe) -> Difference:
    what, at = [], None
    for r in records:
        kept = r.entries.get(count)
        if kept is not None:
            entry = Entry(*kept[1])
            at = at or entry
            what.append(f"ran {describe(entry)} ({PHASE_NAMES[entry.phase]} of step "
                        f"{entry.step})")
        elif r.count < count and r.kind == CHECK:
            what.append(f"ended the {PHASE_NAMES[r.phase]} after entry #{r.count}")
        elif r.count < count and r.kind == ELSEWHERE:
            what.append(f"went on to another sharded model's check after entry #{r.count}")
        elif r.count < count:
            what.append(f"was still waiting in a collective after entry #{r.count}")
        else:
            what.append(f"kept no record of entry #{count} (its ledger keeps the last "
                        "entries only)")
    if at is not None:
        return Difference(count, at.step, PHASE_NAMES[at.phase], what)
    ended = next((r for r in records if r.kind == CHECK), None)
    return Difference(count, -1, PHASE_NAMES[ended.phase] if ended is not None else
                      "a collective", what)


def _ranks(ranks: list[int]) -> str:
    return (f"rank {ranks[0]}" if len(ranks) == 1 else
            "ranks " + ", ".join(str(r) for r in ranks))
