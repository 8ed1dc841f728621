"""Replay fullshard's buffer schedule over a traced step, at unit granularity.

Note [the estimate replays the schedule]
Peak memory is not the sum of every buffer's largest size: the root's gathered
parameters live from forward to the end of backward, the next unit's all-gather
is in flight while the current one computes, a reduce-scatter's buffers overlap
the next unit's backward, and activations shrink as gradients grow. So the
estimator walks the events of a traced step (activations.py) and, at each one,
does with byte counts what core/hooks.py and core/group.py do with tensors:
gather into a pooled buffer and copy out into the unsharded buffer, prefetch one
group ahead in forward and one behind in backward, free after forward (or keep
1/N of it for hpZ), accumulate unsharded gradients, reduce them through pooled
send (and, on gloo, receive) buffers into persistent or fresh sharded gradients,
then step the optimizer. Pooled buffers follow BufferPool's rule (kept up to
``max_numel`` elements, two per size), so after the first step they are part of
the steady state. The largest total seen, with the activations alive at that
moment, is the peak; the breakdown is what was alive then.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .activations import StepTrace
from .units import GroupLayout

SHARDED_PARAMS = "sharded parameters"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer states"
UNSHARDED = "unsharded parameters"
ACTIVATIONS = "activations"
COMMUNICATION = "communication buffers"
CATEGORIES = (SHARDED_PARAMS, GRADIENTS, OPTIMIZER, UNSHARDED, ACTIVATIONS, COMMUNICATION)


@dataclass(frozen=True)
class RunSettings:
    """How fullshard runs the step, in the terms that decide its buffers."""

    param_bytes: int          # element size of shards, sharded gradients, optimizer states
    compute_bytes: int        # of gathered parameters and unsharded gradients
    reduce_bytes: int         # of the reduce-scatter buffers
    optimizer_states: int     # state tensors per parameter (AdamW: 2)
    foreach_optimizer: bool   # CUDA's default: one temporary the size of all shards
    scratch_for_reduce: bool  # gloo: reduce-scatter receives into a full-size buffer
    pool_max_numel: int       # BufferPool.max_numel (also the persistent-gradient limit)
    offload: bool             # shards, gradients, states on the host
    replicated: bool = False  # shard groups of one rank, replicas all-reduce (no_shard)
    heap_retention: bool = False  # CPU: freed small blocks stay resident (activations.py)


@dataclass
class Peak:
    total: int = -1
    breakdown: dict[str, int] = field(default_factory=dict)


class _Ledger:
    """Bytes alive per category, for the device and (offload) the host."""

    def __init__(self):
        self.device: Counter = Counter()
        self.host = 0
        self._live: dict[object, tuple[str, int, bool]] = {}

    def alloc(self, key: object, category: str, nbytes: int, on_host: bool = False) -> None:
        assert key not in self._live, key
        self._live[key] = (category, nbytes, on_host)
        if on_host:
            self.host += nbytes
        else:
            self.device[category] += nbytes

    def free(self, key: object) -> None:
        category, nbytes, on_host = self._live.pop(key)
        if on_host:
            self.host -= nbytes
        else:
            self.device[category] -= nbytes

    def holds(self, key: object) -> bool:
        return key in self._live


class _Pool:
    """BufferPool with byte counts: same keys, same keep-or-drop rule."""

    def __init__(self, ledger: _Ledger, max_numel: int, max_per_key: int = 2):
        self.ledger = ledger
        self.max_numel = max_numel
        self.max_per_key = max_per_key
        self._free: dict[tuple[int, int], list[object]] = {}
        self._count = 0

    def take(self, numel: int, itemsize: int) -> tuple:
        free = self._free.get((numel, itemsize))
        if free:
            return free.pop()
        self._count += 1
        handle = ("pool", self._count, numel, itemsize)
        self.ledger.alloc(handle, COMMUNICATION, numel * itemsize)
        return handle

    def give(self, handle: tuple | None) -> None:
        if handle is None:
            return
        _, _, numel, itemsize = handle
        free = self._free.setdefault((numel, itemsize), [])
        if numel > self.max_numel or len(free) >= self.max_per_key:
            self.ledger.free(handle)
        else:
            free.append(handle)


@dataclass
class _Group:
    layout: GroupLayout
    index: int
    state: str = "sharded"     # sharded | gathering | unsharded | post_forward
    gather: tuple | None = None
    grads_seen: int = 0
    inputs_pending: int = 0
    persistent_grads: bool = False


class Replay:
    """One fullshard training step as byte counts (see the module note)."""

    def __init__(self, groups: list[GroupLayout], trace: StepTrace, settings: RunSettings,
                 unit_names: list[str]):
        self.settings = settings
        self.trace = trace
        self.ledger = _Ledger()
        self.pool = _Pool(self.ledger, settings.pool_max_numel)
        self.groups = [_Group(g, i) for i, g in enumerate(groups)]
        self.group_of_unit = {u: g for g in self.groups for u in g.layout.units}
        self.group_of_param = {p.key: g for g in self.groups for p in g.layout.trainable}
        self.root_unit = len(unit_names) - 1
        self.next_in_forward = _nearest_other(trace.forward_order, self.group_of_unit)
        post_order = [e.subject for e in trace.events if e.kind == "post_forward"]
        self.prev_in_forward = _nearest_other(list(reversed(post_order)), self.group_of_unit)
        self.peaks: dict[str, Peak] = {}
        self.activations = 0
        self.phase = "forward"
        self._pending: tuple | None = None
        self._reduced: set[int] = set()
        self._forward_done: set[int] = set()
        self._allocate_model_states()

    # -- steady state -----------------------------------------------------------------
    def _allocate_model_states(self) -> None:
        s = self.settings
        for g in self.groups:
            shard = g.layout.shard_numel * s.param_bytes
            self.ledger.alloc(("shard", g.index), SHARDED_PARAMS, shard, s.offload)
            trainable = sum(p.shard_numel(g.layout.shard_size) for p in g.layout.trainable)
            self.ledger.alloc(("states", g.index), OPTIMIZER,
                              s.optimizer_states * trainable * s.param_bytes, s.offload)
            # Note [persistent sharded gradients]: small groups keep one gradient buffer
            if g.layout.trainable and g.layout.reduce_numel <= s.pool_max_numel:
                g.persistent_grads = True
                self.ledger.alloc(("grad", g.index), GRADIENTS,
                                  g.layout.reduce_numel * s.param_bytes, s.offload)

    def run(self, steps: int = 2) -> dict[str, Peak]:
        """Replay ``steps`` steps; the peaks of the last one (pools warmed up)."""
        for _ in range(steps):
            self.peaks = {}
            self._step()
        return self.peaks

    def _step(self) -> None:
        self.phase = "forward"
        for g in self.groups:
            g.grads_seen, g.inputs_pending = 0, 0
        self._forward_done.clear()
        retained = 0  # Note [freed small blocks stay resident]
        for event in self.trace.events:
            if self.settings.heap_retention:
                retained = self.trace.small_peak - event.small_live
            self.activations = event.live + retained
            self._sample()
            getattr(self, "_on_" + event.kind)(event.subject)
            self._sample()
            if event.kind == "forward_end":
                self.phase = "backward"
            self.activations = event.peak_after + retained
            self._sample()
        self.activations = self.trace.small_peak if self.settings.heap_retention else 0
        self.phase = "optimizer"
        self._optimizer_step()

    def _sample(self, extra: int = 0) -> None:
        breakdown = {c: self.ledger.device[c] for c in CATEGORIES}
        breakdown[ACTIVATIONS] += self.activations
        breakdown[OPTIMIZER] += extra
        total = sum(breakdown.values())
        peak = self.peaks.setdefault(self.phase, Peak())
        if total > peak.total:
            peak.total, peak.breakdown = total, breakdown

    # -- forward ----------------------------------------------------------------------
    def _on_pre_forward(self, unit: int) -> None:
        group = self.group_of_unit.get(unit)
        if unit == self.root_unit:
            for g in self.groups:
                if g.state != "sharded":
                    self._reshard(g)
            self._forward_done.clear()
        if group is not None:
            self._unshard(group)
            self._wait(group)
            if group.layout.units and unit in self.trace.watched_inputs:
                group.inputs_pending += 1
        self._prefetch(self.next_in_forward.get(unit))

    def _on_post_forward(self, unit: int) -> None:
        group = self.group_of_unit.get(unit)
        self._forward_done.add(unit)
        if group is None or unit == self.root_unit or group.layout.is_root:
            return
        if group.layout.reshard_after_forward is False:
            return
        if all(u in self._forward_done for u in group.layout.units):
            if group.layout.reshard_after_forward is not True:  # hpZ: keep 1/N
                n = group.layout.reshard_after_forward
                self.ledger.alloc(("chunk", group.index), UNSHARDED,
                                  self._unsharded_bytes(group) // n)
                self._sample()
                self._free_unsharded(group)
                group.state = "post_forward"
            else:
                self._reshard(group)

    def _on_forward_end(self, _subject: int) -> None:
        pass

    # -- backward ---------------------------------------------------------------------
    def _on_pre_backward(self, unit: int) -> None:
        group = self.group_of_unit.get(unit)
        if group is not None and group.index not in self._reduced:
            self._unshard(group)
            self._wait(group)
        self._prefetch(self.prev_in_forward.get(unit))

    def _on_grad(self, key: int) -> None:
        group = self.group_of_param.get(key)
        if group is None:
            return
        param = next(p for p in group.layout.trainable if p.key == key)
        self.ledger.alloc(("ugrad", key), GRADIENTS, param.numel * self.settings.compute_bytes)
        group.grads_seen += 1
        self._maybe_post_backward(group)

    def _on_inputs_ready(self, unit: int) -> None:
        group = self.group_of_unit.get(unit)
        if group is not None:
            group.inputs_pending -= 1
            self._maybe_post_backward(group)

    def _maybe_post_backward(self, group: _Group) -> None:
        if group.index in self._reduced:
            return
        if group.grads_seen >= len(group.layout.trainable) and group.inputs_pending <= 0:
            self._post_backward(group)

    def _on_backward_end(self, _subject: int) -> None:
        for g in self.groups:  # the final callback: groups whose countdown never completed
            if g.index not in self._reduced:
                self._post_backward(g)
        self._finish_pending_reduce()
        for g in self.groups:
            self._reshard(g)
        self._reduced.clear()

    def _post_backward(self, group: _Group) -> None:
        s, layout = self.settings, group.layout
        self._finish_pending_reduce()
        self._reshard(group)
        self._reduced.add(group.index)
        if not layout.trainable:
            return
        w = layout.shard_size
        full = self.pool.take(w * layout.reduce_numel, s.reduce_bytes)
        self._sample()  # the unsharded gradients are copied into ``full``, then freed
        for p in layout.trainable:
            if self.ledger.holds(("ugrad", p.key)):
                self.ledger.free(("ugrad", p.key))
        scratch = self.pool.take(w * layout.reduce_numel, s.reduce_bytes) \
            if s.scratch_for_reduce and w > 1 else None
        if not group.persistent_grads:
            self.ledger.alloc(("grad", group.index), GRADIENTS,
                              layout.reduce_numel * s.param_bytes, s.offload)
        out = None
        direct = w == 1 and s.replicated  # all-reduced in ``full``, then copied over
        if not direct and (s.reduce_bytes != s.param_bytes or s.offload):
            out = ("out", group.index)
            self.ledger.alloc(out, COMMUNICATION, layout.reduce_numel * s.reduce_bytes)
        self._sample()
        self._pending = (full, scratch, out)

    def _finish_pending_reduce(self) -> None:
        if self._pending is None:
            return
        full, scratch, out = self._pending
        self._pending = None
        self.pool.give(full)
        self.pool.give(scratch)
        if out is not None:
            self.ledger.free(out)

    # -- gathering --------------------------------------------------------------------
    def _unsharded_bytes(self, group: _Group) -> int:
        return group.layout.unsharded_numel * self.settings.compute_bytes

    def _unshard(self, group: _Group) -> None:
        s, layout = self.settings, group.layout
        if group.state == "post_forward":  # hpZ: gather the chunks straight into place
            self.ledger.alloc(("unsharded", group.index), UNSHARDED, self._unsharded_bytes(group))
            group.state = "gathering"
            group.gather = ("chunk", group.index)
            return
        if group.state != "sharded":
            return
        copy_in = s.compute_bytes != s.param_bytes or s.offload  # a cast / a host copy
        if layout.shard_size == 1:  # Note [shard groups of one rank]: no collective
            if copy_in or layout.reshard_after_forward not in (True, False):
                self.ledger.alloc(("unsharded", group.index), UNSHARDED,
                                  self._unsharded_bytes(group))
            group.state = "unsharded"  # otherwise the parameters are views of the shard
            return
        sends = [self.pool.take(layout.shard_numel, s.compute_bytes)] if copy_in else []
        out = self.pool.take(layout.unsharded_numel, s.compute_bytes)
        group.gather = (out, sends)
        group.state = "gathering"

    def _wait(self, group: _Group) -> None:
        if group.state != "gathering":
            return
        if group.gather == ("chunk", group.index):
            self._sample()
            self.ledger.free(("chunk", group.index))
        else:
            out, sends = group.gather
            for send in sends:
                self.pool.give(send)
            self.ledger.alloc(("unsharded", group.index), UNSHARDED, self._unsharded_bytes(group))
            self._sample()  # copy-out: gathered and unsharded both alive
            self.pool.give(out)
        group.gather = None
        group.state = "unsharded"

    def _prefetch(self, group: _Group | None) -> None:
        if group is not None and group.state == "sharded" and group.index not in self._reduced:
            self._unshard(group)

    def _free_unsharded(self, group: _Group) -> None:
        if self.ledger.holds(("unsharded", group.index)):
            self.ledger.free(("unsharded", group.index))

    def _reshard(self, group: _Group) -> None:
        if group.state == "gathering":
            self._wait(group)
        if self.ledger.holds(("chunk", group.index)):
            self.ledger.free(("chunk", group.index))
        self._free_unsharded(group)
        group.state = "sharded"

    # -- optimizer --------------------------------------------------------------------
    def _optimizer_step(self) -> None:
        s = self.settings
        shards = [p.shard_numel(g.layout.shard_size) * s.param_bytes
                  for g in self.groups for p in g.layout.trainable]
        if s.offload or not shards or not s.optimizer_states:
            temporaries = 0  # offloaded: the step runs on the host
        elif s.foreach_optimizer:
            temporaries = sum(shards)      # e.g. _foreach_sqrt of every second moment
        else:
            temporaries = 2 * max(shards)  # one parameter's sqrt(v) and its quotient
        self._sample(extra=temporaries)
        for g in self.groups:  # zero_grad(set_to_none=True): fresh gradients die
            if not g.persistent_grads and self.ledger.holds(("grad", g.index)):
                self.ledger.free(("grad", g.index))


def _nearest_other(order: list[int], group_of_unit: dict) -> dict[int, _Group]:
    """For each unit, the nearest group after it in ``order`` that is not its own
    (RootState's next/prev group, repeats collapsed)."""
    nearest: dict[int, _Group] = {}
    upcoming: list[_Group] = []
    for unit in reversed(order):
        own = group_of_unit.get(unit)
        later = [g for g in upcoming[-2:] if g is not own]
        if later:
            nearest[unit] = later[-1]
        if own is not None and (not upcoming or upcoming[-1] is not own):
            upcoming.append(own)
    return nearest
