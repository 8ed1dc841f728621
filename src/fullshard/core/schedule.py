"""The decisions behind a step's buffers, as functions of plain sizes, dtypes and flags.

Note [one schedule for the runtime and the estimate]
core/hooks.py, core/group.py and core/state.py act on tensors; the memory estimator
(memory/replay.py) does the same with byte counts. Each decision that both need is
made in one place in core, on plain values, and both call it:

* which group to prefetch: ``PrefetchOrder`` (the next other group in forward, the
  previous other group in backward);
* what a unit keeps after forward: ``after_forward_rule`` (fully_shard's argument as
  the unit keeps it, and the hpZ subgroup size) and ``frees_after_forward`` (the root's
  rule); when every unit gathered by one group has run forward: ``ForwardsFinished``;
* which units are gathered together: ``plan_runs`` with ``joins_bucket`` (core/buckets.py);
* when a group's backward is done: ``backward_is_done`` (the runtime counts its signals
  in ``BackwardSignals``);
* what an unshard allocates: ``gather_plan``, and whether it copies the shard in first:
  ``copies_shard_in``; what a gradient reduction allocates:
  ``reduce_plan`` and ``reduce_numel`` (gloo's receive buffer:
  ``comm.receives_into_scratch``);
* which buffers are pooled and kept, and which groups keep persistent sharded
  gradients: ``FreeLists.keeps`` (core/comm.py).

The order of the actions inside each moment (a post-backward finishes the reduction in
flight, then frees the parameters, then starts its own reduction) is written in both
hooks.py and replay.py; tests/memory/test_replay.py runs the runtime and the replay on
the same model and compares their sequences of gathers, frees, pooled buffers and
reductions, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, NamedTuple, Sequence, TypeVar

import torch

from .comm import receives_into_scratch, skips_collectives

U = TypeVar("U", bound=Hashable)  # a unit (UnitState; an index in the estimator)
G = TypeVar("G")                  # a group (ParamGroup; a byte-count group in the estimator)
T = TypeVar("T")


# -- prefetching ----------------------------------------------------------------------------
class _Trail(Generic[G]):
    """Groups in the order they were reported, repeats collapsed."""

    def __init__(self) -> None:
        self._groups: list[G] = []

    def other_than(self, group: G | None) -> G | None:
        """The most recently reported group that is not ``group``."""
        earlier = [g for g in self._groups[-2:] if g is not group]
        return earlier[-1] if earlier else None

    def add(self, group: G | None) -> None:
        if group is not None and (not self._groups or self._groups[-1] is not group):
            self._groups.append(group)


def _nearest_other(order: Sequence[U], group_of: Callable[[U], G | None]) -> dict[U, G]:
    """For each unit, the nearest group after it in ``order`` that is not its own."""
    nearest: dict[U, G] = {}
    trail: _Trail[G] = _Trail()
    for unit in reversed(order):
        group = group_of(unit)
        other = trail.other_than(group)
        if other is not None:
            nearest[unit] = other
        trail.add(group)
    return nearest


class PrefetchOrder(Generic[U, G]):
    """Which group to prefetch while a unit's group computes.

    Note [prefetch order]
    Forward prefetches the first other group that ran after the unit in the last
    complete iteration (by first pre-forward; a unit run twice is prefetched for its
    first run), so the first iteration prefetches nothing in forward. Backward runs
    forward's post-forward order in reverse: it prefetches the last other group whose
    forward finished before the unit's in this iteration. Repeats of a group (units
    gathered in one batch) are collapsed, so a batch never prefetches itself.
    """

    def __init__(self, group_of: Callable[[U], G | None]):
        self._group_of = group_of
        self.forward_order: list[U] = []  # the last complete iteration's
        self._next: dict[U, G] = {}
        self._recording: list[U] = []     # this iteration's pre-forward order
        self._recorded: set[U] = set()
        self._prev: dict[U, G] = {}
        self._trail: _Trail[G] = _Trail()  # this iteration's post-forward order

    def record_pre_forward(self, unit: U) -> None:
        if unit not in self._recorded:
            self._recording.append(unit)
            self._recorded.add(unit)

    def record_post_forward(self, unit: U) -> None:
        group = self._group_of(unit)
        other = self._trail.other_than(group)
        if other is not None:
            self._prev[unit] = other
        self._trail.add(group)

    def start_iteration(self) -> None:
        """Adopt the order recorded since the last start (if any) for forward prefetching."""
        if self._recording:
            self.forward_order = self._recording
            self._next = _nearest_other(self.forward_order, self._group_of)
        self.forget_recording()
        self._prev = {}
        self._trail = _Trail()

    def forget_recording(self) -> None:
        """Drop the order recorded so far (an aborted iteration must not be adopted)."""
        self._recording = []
        self._recorded = set()

    def next_in_forward(self, unit: U) -> G | None:
        return self._next.get(unit)

    def prev_in_forward(self, unit: U) -> G | None:
        return self._prev.get(unit)


# -- after forward --------------------------------------------------------------------------
class AfterForward(NamedTuple):
    """What a unit does with its gathered parameters after forward."""

    reshard: bool | int | None     # fully_shard's ``reshard_after_forward`` as the unit keeps it
    post_forward_size: int | None  # hpZ: the parameters stay sharded over this many ranks


def after_forward_rule(reshard_after_forward: bool | int | None, shard_size: int) -> AfterForward:
    """``fully_shard``'s (validated) ``reshard_after_forward`` for a shard group of
    ``shard_size`` ranks. An int N: 1 keeps everything (False, ZeRO-2), the shard group
    size frees everything (as True), a size in between keeps 1/N (Note [resharding after
    forward to a smaller group])."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return AfterForward(reshard_after_forward, None)
    n = reshard_after_forward
    if n == 1:
        return AfterForward(False, None)
    return AfterForward(n, n if n < shard_size else None)


def frees_after_forward(reshard_after_forward: bool | int | None, is_root: bool) -> bool:
    """torch's rule: ``None`` means True below the root and False at the root (backward
    starts with the root, so freeing it would only gather it again at once); an explicit
    ``True`` or N on the root is honoured (N keeps 1/N, Note [resharding after forward
    to a smaller group]; ``after_forward_rule`` has made an N of 1 ``False``)."""
    if is_root and reshard_after_forward is None:
        return False
    return reshard_after_forward is not False


class ForwardsFinished(Generic[U, G]):
    """Which units finished forward this iteration, and whether all the units a group
    gathers have: a count per group of its units still to run, so that a unit's
    post-forward costs the same whatever its group holds. A unit run again counts once,
    and its group, finished, stays so (it reshards again after that call too)."""

    def __init__(self) -> None:
        self.start_iteration()

    def start_iteration(self) -> None:
        self._done: set[U] = set()
        self._left: dict[G, int] = {}

    def finished(self, unit: U, group: G, units_in_group: int) -> bool:
        """Record ``unit``'s forward; True once all ``units_in_group`` units of ``group``
        have run this iteration."""
        if unit not in self._done:
            self._done.add(unit)
            self._left[group] = self._left.get(group, units_in_group) - 1
        return self._left[group] == 0


def joins_bucket(first: AfterForward, first_is_root: bool, other: AfterForward) -> bool:
    """Whether a unit with rule ``other`` may share a group with a run of units that
    starts with ``first``, as far as freeing after forward goes: the same rule below the
    root (None and True both free), anything in the root's run, whose members then follow
    the root's rule (Note [buckets: units gather together])."""
    return first_is_root or (
        frees_after_forward(first.reshard, False) == frees_after_forward(other.reshard, False)
        and first.post_forward_size == other.post_forward_size)


def plan_runs(items: Sequence[T], numel: Callable[[T], int],
              compatible: Callable[[T, T], bool], bucket_numel: int) -> list[list[T]]:
    """Runs of adjacent items, each compatible with its run's first, whose unsharded
    sizes sum to at most ``bucket_numel`` (Note [buckets: units gather together]);
    ``bucket_numel <= 0``: every item alone."""
    if bucket_numel <= 0:
        return [[item] for item in items]
    runs: list[list[T]] = []
    current: list[T] = []
    size = 0
    for item in items:
        n = numel(item)
        if current and (size + n > bucket_numel or not compatible(current[0], item)):
            runs.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        runs.append(current)
    return runs


# -- backward -------------------------------------------------------------------------------
def backward_is_done(watches_fired: int, watches_live: int, unwatched_calls: int) -> bool:
    """The input gradients of every watched forward call are computed (at least one in
    this backward) and no forward call went unwatched: the unit's module backward is over
    (Note [when a unit's backward is done] in core/hooks.py)."""
    return watches_fired > 0 and watches_live <= 0 and unwatched_calls == 0


class BackwardSignals:
    """Whether one unit's backward is over, from the module-boundary signals.

    The hooks (core/hooks.py) watch each forward call's inputs; this object counts what
    those watches report for one unit's group (Note [when a unit's backward is done]):
    forward calls whose inputs are watched and whose input gradients are still to come,
    those already computed in this backward, and forward calls with grad whose inputs
    needed none (never watched). The estimator's trace (memory/activations.py) records
    the same three signals with a stand-in of its own. ``on_done`` runs after each
    computed input gradient (the hooks check ``done`` there and reduce the unit when it
    is)."""

    __slots__ = ("live", "fired", "unwatched_calls", "epoch", "on_done")

    def __init__(self) -> None:
        self.live = 0
        self.fired = 0
        self.unwatched_calls = 0
        self.epoch = 0  # bumped when a backward is forgotten: older watches are void
        self.on_done: Callable[[], None] | None = None

    @property
    def done(self) -> bool:
        """The gradients of every watched forward input are computed and no forward call
        went unwatched: the unit's backward is over."""
        return backward_is_done(self.fired, self.live, self.unwatched_calls)

    def end_backward(self) -> None:
        """Forget this backward's signals (the final callback; watches of forwards it did
        not reach stay live until their graphs are freed). While some stay live, a kept
        graph (``retain_graph=True``) may be backpropagated again through the unwatched
        calls it also holds: they keep counting, so that backward reduces the unit in its
        final callback, after their gradients, not when the live watches fire."""
        self.fired = 0
        if self.live <= 0:
            self.unwatched_calls = 0

    def forget(self) -> None:
        """Drop every watch, live ones too (``reset_iter_state``): they no longer count."""
        self.end_backward()
        self.live = 0
        self.epoch += 1

    # what one watch reports
    def watch_started(self) -> None:
        self.live += 1

    def watch_dropped(self) -> None:
        """A watched forward's graph was freed without a backward through it."""
        self.live -= 1

    def input_grads_ready(self) -> None:
        self.live -= 1
        self.fired += 1
        if self.on_done is not None:
            self.on_done()


# -- buffers --------------------------------------------------------------------------------
def shard_device_for(offload: bool, compute_device: torch.device) -> torch.device:
    """Where the flat shard, the sharded gradients and the optimizer states live
    (Note [CPU offload])."""
    return torch.device("cpu") if offload else compute_device


class GatherPlan(NamedTuple):
    """The buffers one unshard of a sharded group uses."""

    cast: bool        # the shard is cast / moved into its chunk of the gathered buffer first
    gathered: bool    # an all-gather into a rank-major buffer, then copied out
    unsharded: bool   # the unsharded parameters have their own buffer, not the shard's


def gather_plan(*, shard_size: int, shard_dtype: torch.dtype, shard_device: torch.device,
                compute_dtype: torch.dtype, compute_device: torch.device,
                post_forward: bool, delayed: bool = False) -> GatherPlan:
    """What gathering a group allocates. One rank per shard group (Note [shard groups of
    one rank]): no collective, and where the shard already is what forward computes with
    (its dtype, its device: no cast, no copy off the host as under CPU offload to an
    accelerator) and no post-forward subgroup, the parameters are views of the shard
    itself (unless the one-rank shortcuts are off: ``comm.skips_collectives``), except for
    a ``delayed`` unit, whose gathers read a copy while a host thread writes the shard
    (Note [the delayed update]). A cast needs no buffer of its own (Note [in-place
    all-gather])."""
    if skips_collectives(shard_size):
        aliased = (shard_device == compute_device and not post_forward
                   and compute_dtype == shard_dtype and not delayed)
        return GatherPlan(cast=False, gathered=False, unsharded=not aliased)
    cast = (compute_dtype, compute_device) != (shard_dtype, shard_device)
    return GatherPlan(cast=cast, gathered=True, unsharded=True)


def copies_shard_in(plan: GatherPlan, batched: bool) -> bool:
    """Whether an unshard under ``plan`` copies the shard into a buffer before it computes
    (what a copy kept on the device serves, Note [parameters kept on the device]): at one
    rank, into the parameters' own buffer unless they are views of the shard; otherwise a
    cast or move into this rank's chunk of the gathered buffer, or a ``batched`` group's
    members' shards copied into theirs (a batch has no flat shard of its own to send:
    Note [in-place all-gather]). The runtime's all-gathers (core/group.py; at one rank it
    asks the buffer it built, which this plan built) and the estimate's copy kept on the
    device (memory/run_settings.py) both ask here."""
    if not plan.gathered:
        return plan.unsharded
    return plan.cast or batched


class ReducePlan(NamedTuple):
    """The buffers a group's gradient reduction uses besides its pooled send buffer."""

    all_reduce: bool  # one rank per shard group, with replicas: all-reduced in the send buffer
    scratch: bool     # a pooled send-sized receive buffer (gloo's reduce-scatter)
    output: bool      # a buffer in the reduce dtype, then cast / copied into the gradients


def reduce_plan(*, shard_size: int, replicated: bool, backend: str, reduce_dtype: torch.dtype,
                compute_device: torch.device, grad_dtype: torch.dtype,
                grad_device: torch.device) -> ReducePlan:
    """What reducing a group's gradients allocates (Note [shard groups of one rank],
    Note [reduce-scatter on gloo], Note [mixed precision], Note [CPU offload])."""
    if shard_size == 1 and replicated:
        return ReducePlan(all_reduce=True, scratch=False, output=False)
    return ReducePlan(all_reduce=False, scratch=receives_into_scratch(backend, shard_size),
                      output=(reduce_dtype, compute_device) != (grad_dtype, grad_device))
