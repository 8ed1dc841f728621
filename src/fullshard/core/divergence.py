"""The divergence guard: ranks that take different paths fail with a named error.

Note [ranks agree on every collective]
Collectives pair by order: the k-th collective a rank issues on a process group meets the
k-th of every other rank. Ranks that issue different collectives in some order therefore
mix data: on NCCL two same-sized reduce-scatters of different units sum one unit's
gradients into the other's without a word; on gloo a pair of different sizes aborts the
process or hangs. fullshard's own order does not depend on the data (Note [when a unit's
backward is done]); what remains is the model taking different paths on different ranks:
a layer skipped on one rank, a forward on some ranks only (an evaluation under
``if rank == 0:``), a unit whose output one rank never uses. The guard is always on:

* Every rank records each unit's forward and each collective fullshard issues for the
  root's units in its ledger (core/ledger.py): host arithmetic, nothing sent.
* On gloo, every reduce-scatter over all of the root's ranks carries, at the end of each
  rank's chunk, that rank's digest (including this reduction), 8 bits an element, exact
  in any dtype. gloo's reduce-scatter receives every rank's copy of this rank's chunk
  before summing them (Note [reduce-scatter on gloo]), so each rank compares the digests
  then, for free, before the sum is used: equal, everything recorded so far agrees; not,
  the ranks (which all saw the same digests) compare their records and every rank raises
  the same DivergenceError naming the first difference: the step, the unit, what each
  rank did.
* Where no such reduction vouches for the latest entries (NCCL, whose reduce-scatter sums
  the digests away; hybrid sharding and units on part of the ranks, whose reductions do
  not span them all; int8 or custom reductions; a backward without gradient sync), the
  ranks compare (count, digest) in one all-gather of four integers on a gloo group of
  their own when the backward's gradients are settled, before any is handed out; and
  after a forward without grad (no backward will follow), at once.
* A rank that waits in a collective its peers never issue (on gloo, ``wait()`` blocks the
  host) waits in slices of a tenth of FULLSHARD_ARRIVAL_TIMEOUT; after each it posts a
  "stalled" record to the same exchange. Its peers meet it there at their next check (or
  their own stall), and the same comparison either names the divergence or finds the
  ranks consistent (a peer is merely slower, e.g. saving on its own): the stalled rank
  then waits on and the others repeat their check. A rank that reaches no exchange within
  FULLSHARD_ARRIVAL_TIMEOUT (300 s) makes the waiting ranks raise naming where they wait.

On NCCL ``wait()`` does not block the host, it only orders the compute stream after the
collective: a rank that issued an unmatched collective runs on to the end of its
backward, where the host-side exchange names the divergence before any gradient is
handed out, so no wrong sum reaches the optimizer, whatever the device does (it may stay
in the unmatched collective until the process ends; NCCL's watchdog aborts it). A host
that blocks on the device first (``.item()`` inside the model after the mismatch) cannot
reach the check; NCCL's own timeout bounds that wait. On gloo a first mismatched pair of
*different sizes* aborts inside gloo ("Received data size doesn't match expected size")
before any check can run; same-sized ones (identical blocks, the usual case) are named.

Cost: on gloo, with every reduction vouching, no exchange at all: the records, eight
elements per reduction and their comparison (docs/benchmarks.md has W2's figure); on
NCCL one all-gather of four integers per training step, on the host. With
``FULLSHARD_DEBUG=1`` (or ``fully_shard(root, debug=True)``) the ranks compare before every
collective instead, so the first mismatch is named before it is issued, at one exchange
per collective.
"""

from __future__ import annotations

import datetime
import os
import re
import weakref
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from . import arrival
from .comm import note_collective
from .ledger import (BACKWARD, FORWARD, FORWARD_WITH_GRAD, FORWARD_WITHOUT_GRAD, OPERATIONS,
                     PHASE_NAMES, Entry, Ledger)
from .schedule import DIGEST_NUMEL

# Record kinds: a rank at a check (end of a phase, or before a collective in debug mode),
# a rank stalled inside a collective, or a rank at another model's check showing its
# record of the model a peer is stalled in (Note [models sharing the guard's exchange]).
CHECK, STALLED, ELSEWHERE = 0, 1, 2
_FIELDS = 4  # kind, phase checked, count, digest


class DivergenceError(RuntimeError):
    """Ranks issued different collectives (or some never arrived to compare)."""


def debug_enabled(requested: bool) -> bool:
    return requested or os.environ.get("FULLSHARD_DEBUG", "0") not in ("", "0")


# The guard's exchanges are control traffic on their own group, called directly rather
# than through core/comm.py (whose all-gathers move a unit's data, and are counted).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# One gloo group per set of ranks, made by the first root over them (every rank makes
# its roots in the same order) and shared by later roots over the same ranks: a group per
# root would leave sockets open for every model a process ever builds.
_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}

# Note [models sharing the guard's exchange]
# Every root over one set of ranks posts to that set's one group, so a rank stalled in
# one model's collective can meet a peer at another model's check (a student's gather
# waiting while the peer, slower to arrive, ran it and went on to a teacher's forward
# without grad). The two records are then of different ledgers, and comparing them would
# report a divergence that is not there. Each guard has a serial, the order its root was
# made in over those ranks (the same on every rank, as every rank builds its models in one
# order); when a round holds a stalled record of another serial, the ranks exchange once
# more, each its record of the stalled rank's model (``ELSEWHERE`` when it is at another
# model's check), and compare those: a peer that already issued the collective the rank
# waits in is consistent (the stalled rank waits on, the others check again); one that
# never did, and now waits at another model's check, has diverged, and every rank says so.
_SERIALS: dict[tuple[int, ...], int] = {}
_LIVE: "weakref.WeakValueDictionary[tuple, Guard]" = weakref.WeakValueDictionary()


def guarded(ranks: list[int]) -> bool:
    """Whether a root over ``ranks`` gets a guard: more than one rank, each a process of
    its own talking over a real backend (``arrival.communicates``)."""
    return len(ranks) > 1 and arrival.communicates()


# the guard's groups' description: what tools that count collectives tell them apart by
GROUP_DESC = "fullshard_guard"


def prepare(mesh) -> None:
    """Make the guard's group for ``mesh``'s ranks, at ``fully_shard`` time: every rank
    shards its model, while a group made at the first forward would wait forever for a
    rank that never runs one."""
    ranks = mesh.mesh.flatten().tolist()
    if guarded(ranks):
        _group_for(ranks)


def _group_for(ranks: list[int]) -> dist.ProcessGroup:
    key = tuple(ranks)
    if key not in _GROUPS:
        # the group's own timeout ends a check that waits too long with nothing left
        # pending (a wait(timeout=) would leave the all-gather running)
        _GROUPS[key] = dist.new_group(
            ranks, backend="gloo", use_local_synchronization=True,
            timeout=datetime.timedelta(seconds=arrival.timeout_s()), group_desc=GROUP_DESC)
    return _GROUPS[key]


# what a failed exchange says when a peer's process ended (rather than a timeout)
_PEER_GONE = re.compile(r"connection|peer|closed|reset|broken pipe", re.IGNORECASE)


class _Round(NamedTuple):
    """One exchange of (kind, phase, count, digest) in flight."""
    kind: int
    phase: int
    waiting_at: str
    mine: torch.Tensor
    rows: torch.Tensor
    work: object


class _Record(NamedTuple):
    kind: int
    phase: int
    count: int
    agreed: int
    entries: dict[int, tuple[int, Entry]]
    names: dict[int, str]  # this rank's units, to name entries other ranks do not have
    serial: int            # the guard's (Note [models sharing the guard's exchange])


class Guard:
    """Compares one root's ledger across its ranks (Note [ranks agree on every collective])."""

    def __init__(self, ledger: Ledger, ranks: list[int], debug: bool,
                 in_backward: Callable[[], bool]):
        self.ledger = ledger
        self.in_backward = in_backward
        self.ranks = ranks
        self.debug = debug
        self.group = _group_for(ranks)
        key = tuple(ranks)
        self.serial = _SERIALS.get(key, 0)
        _SERIALS[key] = self.serial + 1
        _LIVE[(key, self.serial)] = self
        self.limit_s = arrival.timeout_s()
        self.stall_slice = datetime.timedelta(seconds=self.limit_s / 10)

    # -- recording -------------------------------------------------------------------------
    def phase(self) -> int:
        if self.in_backward():
            return BACKWARD
        return FORWARD_WITH_GRAD if torch.is_grad_enabled() else FORWARD_WITHOUT_GRAD

    def collective(self, operation: str, unit: int, numel: int) -> None:
        """Record a collective about to be issued (debug mode: compare first)."""
        phase = self.phase()
        self.ledger.record(phase, OPERATIONS[operation], unit, numel)
        if self.debug:
            self.check(phase)

    def forward(self, unit: int) -> None:
        """Record a unit's forward starting."""
        self.ledger.record(self.phase(), FORWARD, unit)

    # -- in-band: the digests a reduction carries ------------------------------------------
    def digest_bytes(self) -> list[int]:
        """The ledger's digest now, 8 bits per element (DIGEST_NUMEL elements)."""
        digest = self.ledger.digest
        return [(digest >> (8 * i)) & 0xFF for i in range(DIGEST_NUMEL)]

    def inspector(self, chunk_numel: int):
        """What a reduce-scatter over every rank of the guard calls with the rows it
        received (one per rank, before summing them): every rank's digest, written at
        its issue, against this rank's (Note [ranks agree on every collective])."""
        expected = self.digest_bytes()
        count = self.ledger.count

        def inspect(rows: torch.Tensor) -> None:
            tails = rows[:, chunk_numel - DIGEST_NUMEL:chunk_numel]
            if torch.equal(tails, torch.tensor(expected, dtype=rows.dtype).expand_as(tails)):
                self.ledger.mark_agreed(count)
                return
            self.check(BACKWARD)  # every rank saw the same rows: all come to name it
            raise DivergenceError(  # the records agreed, the digests did not: a collision
                "fullshard: ranks reduced different data under one collective although "
                "their records agree; rerun with FULLSHARD_DEBUG=1 to compare before every "
                "collective.")
        return inspect

    def ensure_agreed(self, phase: int) -> None:
        """Before gradients are handed out: compare, unless a reduction's digests already
        showed every rank agreeing on everything recorded."""
        if self.ledger.agreed == self.ledger.count:
            return
        self.check(phase)

    # -- the checks -----------------------------------------------------------------------
    def check(self, phase: int) -> None:
        """Every rank ended ``phase`` (or, in debug mode, is about to issue a collective)
        having done the same; raise DivergenceError on every rank otherwise."""
        while not self._finish(self._post(CHECK, phase)):
            pass  # a peer was stalled but consistent: it waits on, and we check again

    def stalled(self, what: str) -> None:
        """Called by a wait that has lasted a slice: compare with the peers; return to wait
        on if they are consistent, raise DivergenceError if not."""
        self._finish(self._post(STALLED, -1, waiting_at=what))

    def _post(self, kind: int, phase: int, waiting_at: str = "") -> "_Round":
        ledger = self.ledger
        # made fresh each time: a check may run under inference_mode (its tensors would
        # be inference tensors, which no later in-place write outside it may touch)
        mine = torch.tensor([kind, phase, ledger.count, ledger.digest], dtype=torch.int64)
        rows = torch.empty(len(self.ranks) * _FIELDS, dtype=torch.int64)
        round_ = _Round(kind, phase, waiting_at, mine, rows, None)
        work = self._gather(lambda: _ALL_GATHER(rows, mine, group=self.group, async_op=True),
                            round_)
        return round_._replace(work=work)

    def _finish(self, round_: "_Round") -> bool:
        """Compare one round's records; True when every rank is at a check and agrees,
        False when the ranks are consistent but not all at a check (retry)."""
        self._gather(round_.work.wait, round_)
        ledger = self.ledger
        if round_.kind == CHECK and bool((round_.rows.view(-1, _FIELDS) == round_.mine).all()):
            ledger.mark_agreed()
            return True
        records = self._exchange(self._record(round_.kind, round_.phase), round_)
        stalled = sorted({r.serial for r in records if r.kind == STALLED})
        if stalled and len({r.serial for r in records}) > 1:
            # Note [models sharing the guard's exchange]: compare the stalled model's records
            self._compare_model(stalled[0], round_, records)
            return False
        self._compare(records, ledger)
        if round_.kind == CHECK and all(r.kind == CHECK for r in records):
            ledger.mark_agreed()  # same entries, same check
            return True
        return False

    def _record(self, kind: int, phase: int) -> _Record:
        ledger = self.ledger
        return _Record(kind, phase, ledger.count, ledger.agreed, dict(ledger.entries),
                       ledger.unit_names, self.serial)

    def _exchange(self, record: _Record, round_: "_Round") -> list[_Record]:
        records: list = [None] * len(self.ranks)
        self._gather(lambda: dist.all_gather_object(records, record, group=self.group),
                     round_)
        return records

    def _compare(self, records: list[_Record], ledger: Ledger) -> None:
        """Raise DivergenceError on every rank when the records (all of one model) differ."""
        names = {code: name for r in records for code, name in r.names.items()}
        problem = first_difference(records, lambda entry: ledger.describe(entry, names))
        if problem is not None:
            raise DivergenceError(self._message(problem))

    def _compare_model(self, serial: int, round_: "_Round", records: list[_Record]) -> None:
        """Every rank's record of model ``serial`` (a rank is stalled in it), compared."""
        mine = records[self.ranks.index(dist.get_rank())]
        other = self if serial == self.serial else _LIVE.get((tuple(self.ranks), serial))
        if other is self:
            record = mine
        elif other is not None:
            record = other._record(ELSEWHERE, -1)
        else:  # the model is gone here: nothing of it recorded
            record = _Record(ELSEWHERE, -1, 0, 0, {}, {}, serial)
        self._compare(self._exchange(record, round_), (other or self).ledger)

    def _gather(self, run, round_: "_Round"):
        try:
            result = run()
            note_collective()  # an exchange is a collective: Note [collectives settle before exit]
            return result
        except RuntimeError as err:
            ledger = self.ledger
            where = (f"waited in the {round_.waiting_at} (step {ledger.step}), then"
                     if round_.kind == STALLED else
                     f"ended the {PHASE_NAMES[round_.phase]} of step {ledger.step} and")
            why = ("a peer went away" if _PEER_GONE.search(str(err)) else
                   f"not every rank came within {self.limit_s:g} s")
            raise DivergenceError(
                f"fullshard: rank {dist.get_rank()} {where} waited for the other ranks to "
                f"compare what they ran, but {why}: a rank stopped, is busy in code of its "
                "own (a save or an evaluation under `if rank == 0:`?) or ran fewer sharded "
                f"modules; {arrival.TIMEOUT_VARIABLE} sets how long to wait.") from None

    # -- the message ------------------------------------------------------------------------
    def _message(self, problem: "Difference") -> str:
        groups: dict[str, list[int]] = {}
        for rank, text in zip(self.ranks, problem.what):
            groups.setdefault(text, []).append(rank)
        said = "; ".join(f"{_ranks(r)} {text}" for text, r in groups.items())
        return (f"fullshard: ranks diverged at step {problem.step} ({problem.phase}, entry "
                f"#{problem.count} of the record): {said}. Every rank must run the same "
                "sharded modules in the same order with the same grad mode: a module skipped, "
                "or a forward, backward or unshard() on some ranks only, pairs their "
                "collectives with the wrong tensors; a shard written in place on some ranks "
                "only while its parameters were kept gathered across backward makes those "
                "ranks gather again.")


class Difference(NamedTuple):
    count: int          # the first entry where the ranks differ
    step: int
    phase: str
    what: list[str]     # per rank: what it did there


def first_difference(records: list[_Record], describe) -> Difference | None:
    """The first entry where the ranks' records disagree, or None when they are
    consistent (equal, or stalled ranks behind the others). The same on every rank: it
    reads only the exchanged records. ``describe(entry)`` names an entry."""
    agreed = min(r.agreed for r in records)
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


def _digest_at(record: _Record, count: int) -> int | None:
    kept = record.entries.get(count)
    return kept[0] if kept is not None else None


def _difference(records: list[_Record], count: int, describe) -> Difference:
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
