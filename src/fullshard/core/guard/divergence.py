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
  root's units in its ledger (core/guard/ledger.py): host arithmetic, nothing sent.
* On gloo, every reduce-scatter over all of the root's ranks carries, at the end of each
  rank's chunk, that rank's digest (including this reduction), 8 bits an element, exact
  in any dtype. gloo's reduce-scatter receives every rank's copy of this rank's chunk
  before summing them (Note [reduce-scatter on gloo]), so each rank compares the digests
  then, for free, before the sum is used: equal, everything recorded so far agrees; not,
  the ranks compare their records and every rank raises the same DivergenceError naming
  the first difference: the step, the unit, what each rank did.
* Where no such reduction vouches for the latest entries (NCCL, whose reduce-scatter sums
  the digests away; hybrid sharding and units on part of the ranks; int8 or custom
  reductions; a backward without gradient sync), the ranks compare once when the
  backward's gradients are settled, and after a forward without grad (no backward
  follows). A comparison is one all-reduce (MAX) of ten integers on the control channel
  (core/guard/control.py): each rank's (kind, phase, count, digest, serial) and their negatives,
  so every rank learns at once whether all were equal, whatever the world size. Only
  when they were not do the ranks exchange their records (core/guard/difference.py).
* On an accelerator the comparison does not stop the host (Note [a comparison one step
  behind]); on CPU, where the host is the device, it waits for it at once.
* A rank that waits in a collective its peers never issue (on gloo, ``wait()`` blocks the
  host) waits in slices (a tenth of the channel's timeout, at most 30 s); after each it
  posts a "stalled" record to the channel. Its peers meet it there at their next
  comparison (or their own stall), and the records either name the divergence or show
  the ranks consistent (a peer is merely slower, e.g. saving on its own): the stalled rank
  then waits on and the others compare again. How long anything waits on the channel is
  the process group's own timeout (core/guard/control.py): a slow rank is waited for as long as
  the collectives of the data would wait for it, and never called divergent.

On NCCL ``wait()`` does not block the host, it only orders the compute stream after the
collective: a rank that issued an unmatched collective runs on, and the comparison on the
channel, which no NCCL collective can pair with, names the divergence. A host that
blocks on the device first (``.item()`` inside the model after the mismatch) cannot
reach the comparison; NCCL's own timeout bounds that wait. On gloo a first mismatched
pair of *different sizes* aborts inside gloo ("Received data size doesn't match expected
size") before any check can run; same-sized ones (identical blocks, the usual case) are
named.

Cost: on gloo, with every reduction vouching, no exchange at all: the records, eight
elements per reduction and their comparison (docs/benchmarks.md has W2's figure);
elsewhere one all-reduce of ten integers per training step on the channel, in flight
while the step runs. With ``FULLSHARD_DEBUG=1`` (or ``fully_shard(root, debug=True)``) the
ranks compare before every collective instead, so the first mismatch is named before it
is issued, at one exchange per collective.

Note [an unshard() on some ranks only]
A user's ``unshard()`` runs outside any forward, so nothing orders it against the peers:
called on some ranks only (a rank-0 evaluation that gathers first), its all-gather pairs
with whatever the peers issue next, on gloo often a gather of another size, and gloo
aborts the process inside its transport before any comparison could name it. Where the
host waits in collectives (CPU, the guard not lagged), such a call therefore compares
before its gather, as debug mode does for every collective: one all-reduce on the
channel per explicit ``unshard()``, nothing for the gathers of forward and backward. A
peer that meanwhile entered a collective meets the comparison after its first stall
slice and every rank names the difference. On accelerators the comparison one step
behind names it instead (a host barrier per call would cost what the lagged guard saves).

Note [a comparison one step behind]
On an accelerator the host runs ahead of the device, and a comparison it waited for at
the end of each backward would be a host barrier: every rank's host waits for the
slowest, and the slack the asynchronous device hides is lost. There the comparison of a
backward is issued when its gradients settle and finished when the next one settles (or
before a check-in: a checkpoint is never written after an unnamed divergence; or when the
interpreter exits, so that the last step's is said too), by when it has long arrived. A divergence is then named one step late, before the second step's
gradients are handed out; the step in between may have summed the wrong tensors, which
is why nothing is saved before the comparison finishes. With CPU offload the host waits
for the device at the settle anyway (the gradients' copies to the host), so the
comparison is finished there, before those copies: a diverged rank whose copies wait
behind an unmatched collective would otherwise never reach it.
"""

from __future__ import annotations

import datetime
import os
import re
import weakref
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from . import control, structure
from ..comm import keep_groups_past_exit, note_collective
from .difference import CHECK, ELSEWHERE, STALLED, Difference, Record, first_difference
from .ledger import (BACKWARD, FORWARD, FORWARD_WITH_GRAD, FORWARD_WITHOUT_GRAD, OPERATIONS,
                     PHASE_NAMES, Ledger, digest_elements)

_FIELDS = 5  # kind, phase, count, digest, serial
STALL_SLICE_MAX_S = 30.0


class DivergenceError(RuntimeError):
    """Ranks issued different collectives (or some never arrived to compare)."""

    def __init__(self, *args):
        super().__init__(*args)
        keep_groups_past_exit()  # Note [groups left with a collective that cannot finish]


def debug_enabled(requested: bool) -> bool:
    return requested or os.environ.get("FULLSHARD_DEBUG", "0") not in ("", "0")


def guarded(ranks: list[int]) -> bool:
    """Whether a root over ``ranks`` gets a guard: more than one rank, each a process of
    its own talking over a real backend (core/guard/control.py)."""
    return len(ranks) > 1 and control.communicates()


def prepare(mesh) -> None:
    """Make the control channel for ``mesh``'s ranks, at ``fully_shard`` time: every rank
    shards its model, while a group made at the first forward would wait forever for a
    rank that never runs one."""
    control.prepare(sorted(mesh.mesh.flatten().tolist()))


# Note [models sharing the guard's exchange]
# Every root over one set of ranks posts to that set's one channel, so a rank stalled in
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

# what a failed exchange says when a peer's process ended (rather than a timeout)
_PEER_GONE = re.compile(r"connection|peer|closed|reset|broken pipe", re.IGNORECASE)


class _Round(NamedTuple):
    """One comparison on the channel: this rank's fields, the all-reduced summary."""
    kind: int
    phase: int
    waiting_at: str
    mine: torch.Tensor     # kind, phase, count, digest, serial
    summary: torch.Tensor  # the fields and their negatives, MAX over the ranks
    work: object


class Guard:
    """Compares one root's ledger across its ranks (Note [ranks agree on every collective]).

    ``lagged``: finish each comparison when the next is due rather than at once (Note [a
    comparison one step behind]); stalled waits are not sliced then (accelerators do not
    block the host in a wait)."""

    def __init__(self, ledger: Ledger, ranks: list[int], debug: bool,
                 in_backward: Callable[[], bool], lagged: bool = False):
        self.ledger = ledger
        self.in_backward = in_backward
        self.ranks = sorted(ranks)  # the channel's group ranks, in its order
        self.debug = debug
        # set around a user's unshard() where the host waits in collectives: compare
        # before its gather (Note [an unshard() on some ranks only])
        self.compare_first = False
        # set while a CUDA graph captures a step: record, exchange nothing (a graph
        # replays no host work; Note [capturing the steady step] in captured/)
        self.quiet = False
        self.lagged = lagged
        key = tuple(self.ranks)
        self.channel = control.prepare(self.ranks)  # made by fully_shard: found here
        self.serial = _SERIALS.get(key, 0)
        _SERIALS[key] = self.serial + 1
        _LIVE[(key, self.serial)] = self
        self.limit_s = self.channel.limit_s
        self.stall_slice = datetime.timedelta(seconds=min(STALL_SLICE_MAX_S, self.limit_s / 10))

    # -- recording -------------------------------------------------------------------------
    def phase(self) -> int:
        if self.in_backward():
            return BACKWARD
        return FORWARD_WITH_GRAD if torch.is_grad_enabled() else FORWARD_WITHOUT_GRAD

    def collective(self, operation: str, unit: int, numel: int) -> None:
        """Record a collective about to be issued (debug mode: compare first)."""
        phase = self.phase()
        self.ledger.record(phase, OPERATIONS[operation], unit, numel)
        if (self.debug or self.compare_first) and not self.quiet:
            self.check(phase)

    def forward(self, unit: int) -> None:
        """Record a unit's forward starting."""
        self.ledger.record(self.phase(), FORWARD, unit)

    # -- in-band: the digests a reduction carries ------------------------------------------
    def inspector(self, read_digests: Callable[[torch.Tensor], torch.Tensor]):
        """What a reduce-scatter over every rank of the guard calls with the rows it
        received (one per rank, before summing them): every rank's digest, written at
        its issue, against this rank's (Note [ranks agree on every collective]).
        ``read_digests`` finds them in the rows (Note [a reduction's chunk])."""
        expected = digest_elements(self.ledger.digest)
        count = self.ledger.count

        def inspect(rows: torch.Tensor) -> None:
            tails = read_digests(rows)
            if torch.equal(tails, torch.tensor(expected, dtype=rows.dtype).expand_as(tails)):
                self.ledger.mark_agreed(count)
                return
            self.check(BACKWARD)  # every rank saw the same rows: all come to name it
            raise DivergenceError(  # the records agreed, the digests did not: a collision
                "fullshard: ranks reduced different data under one collective although "
                "their records agree; rerun with FULLSHARD_DEBUG=1 to compare before every "
                "collective.")
        return inspect

    # -- the checks -----------------------------------------------------------------------
    def compare(self, phase: int, at_once: bool = False) -> None:
        """``phase`` ended: compare, unless a reduction's digests already showed every
        rank agreeing on everything recorded. A lagged guard finishes the comparison
        before this one now and leaves this one in flight, unless ``at_once``."""
        if self.ledger.agreed == self.ledger.count or self.quiet:
            return  # quiet: the records wait for the check after the capture
        if not self.lagged or at_once:
            self.check(phase)
            return
        round_ = self._post(CHECK, phase)
        self.channel.hold(lambda: self._conclude(round_))

    def ensure_agreed(self, phase: int) -> None:
        """Before an error is raised on the ranks' behalf: compare now."""
        self.compare(phase, at_once=True)

    def check(self, phase: int) -> None:
        """Every rank ended ``phase`` (or, in debug mode, is about to issue a collective)
        having done the same; raise DivergenceError on every rank otherwise."""
        while not self._finish(self._post(CHECK, phase)):
            pass  # a peer was stalled but consistent: it waits on, and we check again

    def stalled(self, what: str) -> None:
        """Called by a wait that has lasted a slice: compare with the peers; return to wait
        on if they are consistent, raise DivergenceError if not."""
        self._finish(self._post(STALLED, -1, waiting_at=what))

    def _conclude(self, round_: "_Round") -> None:
        """Finish a comparison left in flight (Note [a comparison one step behind])."""
        if not self._finish(round_):
            self.check(round_.phase)

    def _post(self, kind: int, phase: int, waiting_at: str = "") -> "_Round":
        self.channel.drain()  # one operation in flight on the channel
        ledger = self.ledger
        # made fresh each time: a check may run under inference_mode (its tensors would
        # be inference tensors, which no later in-place write outside it may touch)
        mine = torch.tensor([kind, phase, ledger.count, ledger.digest, self.serial],
                            dtype=torch.int64)
        summary = torch.cat([mine, -mine])
        round_ = _Round(kind, phase, waiting_at, mine, summary, None)
        work = self._gather(lambda: dist.all_reduce(summary, dist.ReduceOp.MAX,
                                                    group=self.channel.group, async_op=True),
                            round_)
        return round_._replace(work=work)

    def _finish(self, round_: "_Round") -> bool:
        """Compare one round's records; True when every rank is at a check and agrees,
        False when the ranks are consistent but not all at a check (retry)."""
        self._gather(round_.work.wait, round_)
        top, bottom = round_.summary[:_FIELDS], -round_.summary[_FIELDS:]
        if round_.kind == CHECK and bool((top == bottom).all()):  # all equal, all at a check
            self.ledger.mark_agreed(int(round_.mine[2]))
            return True
        records = self._exchange(self._record(round_.kind, round_.phase), round_)
        stalled = sorted({r.serial for r in records if r.kind == STALLED})
        if stalled and len({r.serial for r in records}) > 1:
            # Note [models sharing the guard's exchange]: compare the stalled model's records
            self._compare_model(stalled[0], round_, records)
            return False
        self._compare(records, self.ledger)
        if round_.kind == CHECK and all(r.kind == CHECK for r in records):
            self.ledger.mark_agreed()  # same entries, same check
            return True
        return False

    def _record(self, kind: int, phase: int) -> Record:
        ledger = self.ledger
        return Record(kind, phase, ledger.count, ledger.agreed, dict(ledger.entries),
                      ledger.unit_names, self.serial)

    def _exchange(self, record: Record, round_: "_Round") -> list[Record]:
        records: list = [None] * len(self.ranks)
        self._gather(lambda: dist.all_gather_object(records, record,
                                                    group=self.channel.group), round_)
        return records

    def _compare(self, records: list[Record], ledger: Ledger) -> None:
        """Raise DivergenceError on every rank when the records (all of one model) differ."""
        names = {code: name for r in records for code, name in r.names.items()}
        problem = first_difference(records, lambda entry: ledger.describe(entry, names))
        if problem is not None:
            raise DivergenceError(self._message(problem))

    def _compare_model(self, serial: int, round_: "_Round", records: list[Record]) -> None:
        """Every rank's record of model ``serial`` (a rank is stalled in it), compared."""
        mine = records[self.ranks.index(dist.get_rank())]
        other = self if serial == self.serial else _LIVE.get((tuple(self.ranks), serial))
        if other is self:
            record = mine
        elif other is not None:
            record = other._record(ELSEWHERE, -1)
        else:  # the model is gone here: nothing of it recorded
            record = Record(ELSEWHERE, -1, 0, 0, {}, {}, serial)
        self._compare(self._exchange(record, round_), (other or self).ledger)

    # -- the model itself ---------------------------------------------------------------
    def agree_on_model(self, description: tuple, root: str) -> None:
        """Before the root's first collective: every rank sharded the same model, or every
        rank raises DivergenceError naming the first difference (Note [ranks shard the
        same model])."""
        where = f"reached the first forward of '{root}' and"
        self.channel.drain()  # one operation in flight on the channel
        mine = structure.digest(description)
        summary = torch.tensor([mine, -mine], dtype=torch.int64)
        self._gather(lambda: dist.all_reduce(summary, dist.ReduceOp.MAX,
                                             group=self.channel.group), where)
        if int(summary[0]) == -int(summary[1]):
            return
        digests = [torch.zeros(1, dtype=torch.int64) for _ in self.ranks]
        self._gather(lambda: dist.all_gather(digests, torch.tensor([mine]),
                                             group=self.channel.group), where)
        holders: dict[int, list[int]] = {}
        for rank, value in zip(self.ranks, digests):
            holders.setdefault(int(value), []).append(rank)
        groups = []
        for index, (value, ranks) in enumerate(holders.items()):
            shared = [description if value == mine else None]
            if index < structure.MAX_DESCRIBED:
                self._gather(partial(dist.broadcast_object_list, shared, src=ranks[0],
                                     group=self.channel.group), where)
            groups.append((ranks, shared[0]))
        raise DivergenceError(structure.message(root, groups))

    def _gather(self, run, round_: "_Round | str"):
        try:
            result = run()
            note_collective()  # an exchange is a collective: Note [collectives settle before exit]
            return result
        except RuntimeError as err:
            ledger = self.ledger
            where = (round_ if isinstance(round_, str) else
                     f"waited in the {round_.waiting_at} (step {ledger.step}), then"
                     if round_.kind == STALLED else
                     f"ended the {PHASE_NAMES[round_.phase]} of step {ledger.step} and")
            why = ("a peer went away" if _PEER_GONE.search(str(err)) else
                   f"not every rank came within {self.limit_s:g} s (the process group's "
                   "timeout)")
            raise DivergenceError(
                f"fullshard: rank {dist.get_rank()} {where} waited for the other ranks to "
                f"compare what they ran, but {why}: a rank stopped, is busy in code of its "
                "own (a save or an evaluation under `if rank == 0:`?) or ran fewer sharded "
                f"modules; {control.TIMEOUT_VARIABLE} sets how long to wait.") from None

    # -- the message ------------------------------------------------------------------------
    def _message(self, problem: Difference) -> str:
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


def _ranks(ranks: list[int]) -> str:
    return (f"rank {ranks[0]}" if len(ranks) == 1 else
            "ranks " + ", ".join(str(r) for r in ranks))
