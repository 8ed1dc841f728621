"""One training step as fullshard schedules it: compute on one stream, collectives on
another, in the order the runtime issues them (core/schedule.py), with the same prefetch.

Forward: unit i's all-gather may start once unit i - 2 has finished computing (one
gather in flight ahead of the unit computing, as the runtime's forward prefetch keeps it);
unit i computes once its gather landed and unit i - 1 finished. Backward, units in
reverse: the runtime's backward prefetch issues the next unit's all-gather when a unit's
backward starts, and a unit's reduce-scatter when its backward ends; HYBRID_SHARD follows
each reduce-scatter with an all-reduce over the replicas. Collectives run one after
another in issue order (they share the links). Expert parallelism's all-to-alls run on the
compute's path: a block's experts wait for their tokens. A device that cannot overlap (a CPU whose
cores all compute) runs everything back to back.

The step's time not covered by compute is told apart by what the compute waited for: an
all-gather (a unit's forward or backward cannot start before its parameters land), the
reductions (the step cannot end before the last one lands), or expert all-to-alls.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitCost:
    """Seconds one unit costs in one micro-batch."""

    forward: float
    backward: float            # recomputation included
    gather: float              # its forward all-gather (0: nothing to gather)
    regather: float            # its backward all-gather (0: kept gathered since forward)
    reduce: float              # reduce-scatter (or NO_SHARD's all-reduce)
    replica_reduce: float = 0.0  # HYBRID_SHARD's all-reduce across replicas
    # expert parallelism's all-to-alls in one pass (tokens to their experts and back), on
    # the compute's path: the experts wait for their tokens; the same again in backward
    dispatch: float = 0.0
    overhead: float = 0.0      # host overhead included in forward and backward


@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute: float             # sum of compute, optimizer step and host overhead included
    communication: float       # sum of collective time
    exposed: float             # step time not covered by compute: the three below
    exposed_gather: float = 0.0   # compute waiting for all-gathers
    exposed_reduce: float = 0.0   # the step waiting for reduce-scatters and all-reduces
    dispatch: float = 0.0         # expert all-to-alls, on the compute's path
    overhead: float = 0.0         # the host overhead inside ``compute``

    @property
    def hidden(self) -> float:
        return self.communication - self.exposed

    def terms(self) -> dict[str, float]:
        """The step's seconds by what sets them; they sum to ``seconds``."""
        return {"compute": self.compute - self.overhead, "host overhead": self.overhead,
                "exposed all-gather": self.exposed_gather,
                "exposed reduce-scatter": self.exposed_reduce,
                "expert all-to-all": self.dispatch}

    def dominant(self) -> str:
        """The term that takes the largest share of the step."""
        terms = self.terms()
        return max(terms, key=terms.__getitem__)


class _Comm:
    """The collective stream: one at a time, in issue order; and how long the compute
    stream waited on it, per kind of collective."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy = 0.0
        self.waited_gather = 0.0
        self.waited_reduce = 0.0

    def run(self, issued_at: float, seconds: float) -> float:
        start = max(self.free_at, issued_at)
        self.free_at = start + seconds
        self.busy += seconds
        return self.free_at


def micro_batch(units: list[UnitCost], start: float, comm: _Comm) -> float:
    """Forward and backward of one micro-batch from ``start``; returns when the last
    reduction lands."""
    n = len(units)
    gathered = [0.0] * n
    done = [0.0] * n
    for i, u in enumerate(units):
        issue = start if i < 2 else done[i - 2]
        gathered[i] = comm.run(issue, u.gather) if u.gather else issue
        ready = done[i - 1] if i else start
        comm.waited_gather += max(0.0, gathered[i] - ready)
        done[i] = max(ready, gathered[i]) + u.forward + u.dispatch
    clock = done[-1]
    regathered = [0.0] * n
    last = n - 1
    regathered[last] = comm.run(clock, units[last].regather) if units[last].regather else clock
    reduced = clock
    for i in range(last, -1, -1):
        u = units[i]
        begin = max(clock, regathered[i])
        comm.waited_gather += begin - clock
        if i:  # prefetch the next unit in backward order as this one starts
            nxt = units[i - 1]
            regathered[i - 1] = comm.run(begin, nxt.regather) if nxt.regather else begin
        clock = begin + u.backward + u.dispatch
        if u.reduce:
            reduced = comm.run(clock, u.reduce)
        if u.replica_reduce:
            reduced = comm.run(reduced, u.replica_reduce)
    end = max(clock, reduced, comm.free_at)
    comm.waited_reduce += end - clock
    return end


def step_time(units: list[UnitCost], micro_batches: int, optimizer: float,
              overlaps: bool, early: list[UnitCost] | None = None) -> StepTime:
    """One optimizer step: ``micro_batches`` micro-batches, ``units`` the costs of the last
    (and of every one when ``early`` is None), ``early`` those of the ones before it (no
    reduction when gradients accumulate unsharded), then the optimizer."""
    early = units if early is None else early
    batches = [early] * (micro_batches - 1) + [units]
    compute = sum(u.forward + u.backward for b in batches for u in b) + optimizer
    overhead = sum(u.overhead for b in batches for u in b)
    gathers = sum(u.gather + u.regather for b in batches for u in b)
    reduces = sum(u.reduce + u.replica_reduce for b in batches for u in b)
    dispatch = sum(2 * u.dispatch for b in batches for u in b)
    if not overlaps:
        total = compute + gathers + reduces + dispatch
        return StepTime(total, compute, total - compute, total - compute, gathers, reduces,
                        dispatch, overhead)
    comm, clock = _Comm(), 0.0
    for batch in batches:
        clock = micro_batch(batch, clock, comm)
    total = clock + optimizer
    return StepTime(total, compute, comm.busy + dispatch, total - compute,
                    comm.waited_gather, comm.waited_reduce, dispatch, overhead)
