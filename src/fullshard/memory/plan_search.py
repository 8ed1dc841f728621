"""How ``plan`` judges its candidates: each estimated against the budgets, and of a
family of partial offloads the smallest k that fits found without replaying every k.

Note [finding the smallest k]
A model of L blocks has L - 1 partial offloads per family (one strategy, checkpointing,
micro-batch and expert-parallel degree), and plan must not replay them all when L is
large. Offloading one more block moves its shard, gradients and optimizer states off
the device; what it adds there (the copy of its shard in before its gather, its
gradients' before the copy out) is transient, one unit's at a time. So where every
block is a group of its own the device bytes fall (or stay) as k grows, and the host
bytes rise: bisection finds the smallest k that fits the device in about log2 L
replays, and if the host budget refuses that k it refuses every larger one too.
Blocks small enough to merge into buckets (Note [buckets: units gather together]) break
the claim: offloaded units merge only with each other, so a growing k regroups the
blocks, and one larger offloaded bucket's buffers can outgrow what the moved states
free (8 blocks of 12K elements at world size 8 with checkpointing rise again from
k = 3). There the family is scanned k by k: such blocks are small, and so is each
replay. tests/memory/test_plan_fraction.py checks both.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from .estimate import (MemoryEstimate, TracedStep, block_units, estimate_traced,
                       trace_workload)
from .candidate import Candidate
from .units import unit_params

ACCUMULATOR_BYTES = 4  # fp32, the trainer's reduce dtype


def with_accumulators(est: MemoryEstimate, cand: Candidate) -> MemoryEstimate:
    """Note [how plans are ranked]: the unsharded gradients accumulation keeps."""
    if cand.grad_accum == 1 or (cand.strategy == "no_shard"
                                and est.settings["dtype"] == "float32"):
        return est
    extra = ACCUMULATOR_BYTES * est.trainable_params
    return replace(est, lines={**est.lines, "accumulated gradients": extra})


def blocks_stay_apart(step: TracedStep, bucket_numel: int) -> bool:
    """Whether every block is a group of its own, too large to merge with a neighbour
    (Note [finding the smallest k]: then the device bytes fall with k)."""
    if bucket_numel <= 0:
        return True
    owned = unit_params(step.units)
    return all(sum(p.numel() for p in owned[i]) > bucket_numel
               for i in block_units(step.units))


class Judge:
    """Estimates candidates (one trace per checkpointing, micro-batch and expert split,
    replayed for the rest) against the budgets, noting those over them."""

    def __init__(self, model_or_config: Any, world_size: int, seq_len: int | None,
                 trace_kwargs: dict, replay_kwargs: dict, budget_bytes: int,
                 host_budget_bytes: int | None, margin: float):
        self.source, self.world_size, self.seq_len = model_or_config, world_size, seq_len
        self.trace_kwargs, self.replay_kwargs = trace_kwargs, replay_kwargs
        self.budget, self.host_budget, self.margin = budget_bytes, host_budget_bytes, margin
        self.traces: dict[tuple[bool, int, bool], TracedStep] = {}
        self.rejected: list[tuple[Candidate, int]] = []  # negative bytes: the host's

    def trace(self, activation_checkpointing: bool, micro_batch: int,
              split_experts: bool) -> TracedStep:
        key = (activation_checkpointing, micro_batch, split_experts)
        if key not in self.traces:
            self.traces[key] = trace_workload(
                self.source, activation_checkpointing=activation_checkpointing,
                batch_size=micro_batch, seq_len=self.seq_len, split_experts=split_experts,
                **self.trace_kwargs)
        return self.traces[key]

    def estimate(self, cand: Candidate) -> MemoryEstimate:
        step = self.trace(cand.activation_checkpointing, cand.micro_batch, cand.ep > 1)
        return with_accumulators(estimate_traced(
            step, world_size=self.world_size, strategy=cand.strategy,
            offload=cand.offload_mode, ep=cand.ep, **self.replay_kwargs), cand)

    def device_fits(self, est: MemoryEstimate) -> bool:
        return est.total * (1 + self.margin) <= self.budget

    def host_fits(self, est: MemoryEstimate) -> bool:
        return self.host_budget is None or est.host_bytes * (1 + self.margin) <= self.host_budget

    def fits(self, cand: Candidate) -> MemoryEstimate | None:
        """``cand``'s estimate if it fits both budgets; else None, ``cand`` noted."""
        est = self.estimate(cand)
        if not self.device_fits(est):
            self.rejected.append((cand, est.total))
        elif not self.host_fits(est):
            self.rejected.append((cand, -est.host_bytes))
        else:
            return est
        return None

    def smallest_fitting(self, family: list[Candidate], scan: bool
                         ) -> tuple[Candidate, MemoryEstimate] | None:
        """The partial offload of ``family`` (k ascending) with the smallest k that fits
        the device, if the host takes it too (Note [finding the smallest k])."""
        estimates: dict[int, MemoryEstimate] = {}

        def device_fits(i: int) -> bool:
            estimates[i] = est = self.estimate(family[i])
            if not self.device_fits(est):
                self.rejected.append((family[i], est.total))
            return self.device_fits(est)

        if scan:
            first = next((i for i in range(len(family)) if device_fits(i)), None)
        else:
            first = bisect_first(len(family), device_fits)
        if first is None:
            return None
        if not self.host_fits(estimates[first]):
            self.rejected.append((family[first], -estimates[first].host_bytes))
            return None
        return family[first], estimates[first]


def bisect_first(count: int, holds: Callable[[int], bool]) -> int | None:
    """The smallest i < ``count`` for which ``holds(i)``, asking about log2(count) times,
    where ``holds`` is false below some index and true from it on; None if it never
    holds. Whatever ``holds`` does, an answer i holds and i - 1 (if any) does not."""
    if not count or not holds(count - 1):
        return None
    below, at = -1, count - 1  # holds(at); below is -1 or an index where it does not
    while at - below > 1:
        mid = (below + at) // 2
        if holds(mid):
            at = mid
        else:
            below = mid
    return at
