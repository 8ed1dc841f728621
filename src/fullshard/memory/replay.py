"""Replay fullshard's buffer schedule over a traced step, at unit granularity.

Note [the estimate replays the schedule]
Peak memory is not the sum of every buffer's largest size: the root's gathered
parameters live from forward to the end of backward, the next unit's all-gather
is in flight while the current one computes, a reduce-scatter's buffers overlap
the next unit's backward, and activations shrink as gradients grow. So the
estimator walks the events of a traced step (activations.py) and, at each one,
does with byte counts what core/hooks.py and core/group.py do with tensors:
gather into a pooled buffer and copy out into the unsharded buffer, prefetch,
free after forward (or keep 1/N of it for hpZ), accumulate unsharded gradients,
reduce them through pooled send (and, on gloo, receive) buffers into persistent or
fresh sharded gradients, then step the optimizer.

Every decision in that walk is core's, asked with plain sizes and dtypes (Note [one
schedule for the runtime and the estimate] in core/schedule.py): which group to
prefetch (``PrefetchOrder``: none in the first step's forward, as at run time),
what a unit keeps after forward (``frees_after_forward``; the hpZ subgroup from
``after_forward_rule``), when a group's backward is done (``backward_is_done``),
what a gather and a reduction allocate (``gather_plan``, ``reduce_plan``), which
buffers the pool keeps and which groups keep persistent gradients (``FreeLists``).
Tensor-subclass parameters (quantized weights) are gathered as core/features/subclass_params.py
does, beside the flat buffer: a byte send buffer and a receive buffer from the pool,
copied out into each parameter's own outputs, which the unsharded parameter views.
What is written here is the byte accounting and the order of the actions at each
moment, which follows hooks.py; tests/memory/test_replay.py checks that order
against the runtime's. The largest total seen, with the activations alive at that
moment, is the peak; the breakdown is what was alive then.
"""

from __future__ import annotations

import torch

from ..core.features.quantized_collectives import ROWS_PER_PASS, wire_bytes
from ..core.schedule import (ForwardsFinished, GatherPlan, PrefetchOrder, backward_is_done,
                              gather_plan)
from ..offload.files import ALIGN
from ..whole_matrix.recipe import owners_by_cost, step_cost
from .activations import StepTrace
from .reduction_replay import ReductionReplay
from .delayed_copies import allocate_delayed_copies
from .byte_ledger import (ACTIVATIONS, CATEGORIES, COMMUNICATION, GRADIENTS, OPTIMIZER,
                          SHARDED_PARAMS, UNSHARDED, BytePool, ByteLedger, Peak, round_up)
from .run_settings import ReplayGroup, RunSettings
from .units import GroupLayout


def _whole_matrix_numel(s: RunSettings, g: ReplayGroup) -> int:
    """Elements of this rank's shards of the group's Muon matrices."""
    return sum(p.shard_numel(g.layout.shard_size) for p in g.layout.trainable
               if p.key in s.whole_matrix)


def owned_whole_numel(s: RunSettings, groups: list[ReplayGroup]) -> int:
    """Elements of the Muon matrices the most loaded rank steps whole: owners are chosen
    by the step's cost as the optimizer chooses them (Note [whole-matrix optimizers])."""
    muon = [p for g in groups for p in g.layout.trainable if p.key in s.whole_matrix]
    if not muon:
        return 0
    ranks = groups[0].layout.shard_size
    owners = owners_by_cost([step_cost(p.rows, p.numel) for p in muon], ranks)
    return max(sum(p.numel for p, o in zip(muon, owners) if o == r) for r in range(ranks))


def allocate_model_states(ledger: ByteLedger, groups: list[ReplayGroup], s: RunSettings,
                          owned: int = 0) -> int:
    """Enter what a step holds throughout in ``ledger``: each group's shard and its
    optimizer states (on the host with offload), the Muon matrices' whole copies on their
    owners (``owned``: owned_whole_numel), the staging sets for states on disk, the one
    shard paged in at a time for parameters on disk. The bytes kept in files."""
    on_disk = staged = 0  # trainable shard elements whose states live on disk (padded, not)
    disk_param_bytes = paged_shard = 0  # params=True: on disk, largest paged in
    for g in groups:
        flat = g.layout.shard_numel * s.param_dtype.itemsize
        beside = round(g.layout.subclass_shard_bytes(s.param_dtype.itemsize))  # not pinned
        shard = flat + beside
        offloaded = s.offloads(g.layout)  # partial offload: only the last blocks' groups
        if s.params_on_disk and offloaded:  # Note [parameters on disk]: resident while copied in
            disk_param_bytes += shard
            paged_shard = max(paged_shard, shard)
        elif offloaded:  # Note [pinned host blocks]
            ledger.alloc(("shard", g.index), SHARDED_PARAMS,
                         s.host_buffer_bytes(flat) + beside, True)
        else:
            ledger.alloc(("shard", g.index), SHARDED_PARAMS, shard)
        kept_on_device = s.device_copy_bytes(g.layout)  # Note [parameters kept on the device]
        if kept_on_device:
            ledger.alloc(("device copy", g.index), SHARDED_PARAMS, kept_on_device)
        trainable = sum(p.shard_numel(g.layout.shard_size) for p in g.layout.trainable)
        if s.states_on_disk and offloaded:
            # each unit's states start on an aligned boundary of the files, Note [the
            # disk step on the host thread] in offload/optimizer_states.py
            on_disk += round_up(trainable)
            staged += trainable
            continue
        rows = _whole_matrix_numel(s, g)  # Muon's: its states live with the owners
        ledger.alloc(("states", g.index), OPTIMIZER,
                     s.optimizer_states * (trainable - rows) * s.param_dtype.itemsize,
                     offloaded)
        if rows:  # each rank's rows as the last step wrote them
            ledger.alloc(("rows as written", g.index), OPTIMIZER,
                         rows * s.param_dtype.itemsize, offloaded)
    if owned:  # Note [whole-matrix optimizers]: the owner's momentum and whole copy of each
        ledger.alloc("owned whole matrices", OPTIMIZER, 2 * owned * s.param_dtype.itemsize,
                     s.offload)
    if s.states_on_disk and on_disk and s.optimizer_states:
        # Note [optimizer states on disk]: three staging sets of one chunk per state,
        # each buffer allocated ALIGN bytes over to start on an aligned address
        chunk = min(round_up(s.states_on_disk), round_up(staged))
        ledger.alloc("disk staging", OPTIMIZER, 3 * s.optimizer_states
                     * (chunk * s.param_dtype.itemsize + ALIGN), True)
    if paged_shard:  # one unit's shard paged in at a time, counted throughout
        ledger.alloc("paged shard", SHARDED_PARAMS, paged_shard, True)
    allocate_delayed_copies(ledger, groups, s)  # Note [the delayed update]
    return on_disk * s.optimizer_states * s.param_dtype.itemsize + disk_param_bytes


class Replay:
    """One fullshard training step as byte counts (see the module note)."""

    def __init__(self, groups: list[GroupLayout], trace: StepTrace, settings: RunSettings,
                 unit_names: list[str]):
        self.settings = settings
        self.trace = trace
        self.ledger = ByteLedger()
        self.pool = BytePool(self.ledger, settings.pool_max_numel)
        self.groups = [ReplayGroup(g, i) for i, g in enumerate(groups)]
        self.group_of_unit = {u: g for g in self.groups for u in g.layout.units}
        self.group_of_param = {p.key: g for g in self.groups for p in g.layout.trainable}
        self.root_unit = len(unit_names) - 1
        self.order: PrefetchOrder[int, ReplayGroup] = PrefetchOrder(self.group_of_unit.get)
        self.peaks: dict[str, Peak] = {}
        self.activations = 0
        self.phase = "forward"
        self.reductions = ReductionReplay(settings, self.ledger, self.pool, self._sample,
                                          self._sample_with)
        self._reduced: set[int] = set()
        self._forwards: ForwardsFinished[int, int] = ForwardsFinished()  # group indices
        self.owned_whole = owned_whole_numel(settings, self.groups)  # the same every step
        self.largest_whole = max((p.numel for g in self.groups for p in g.layout.trainable
                                  if p.key in settings.whole_matrix), default=0)
        self.disk_bytes = allocate_model_states(self.ledger, self.groups, settings,
                                                self.owned_whole)

    def run(self, steps: int = 2) -> dict[str, Peak]:
        """Replay ``steps`` steps; the peaks of the last one (pools warmed up)."""
        for _ in range(steps):
            self.peaks = {}
            self._step()
        return self.peaks

    def _step(self) -> None:
        self.phase = "forward"
        for g in self.groups:
            g.inputs_pending, g.inputs_fired, g.unwatched = 0, 0, False
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

    def _sample_with(self, nbytes: int) -> None:
        """Sample with a communication temporary of ``nbytes`` alive."""
        self.ledger.alloc(("temporary",), COMMUNICATION, nbytes)
        self._sample()
        self.ledger.free(("temporary",))

    # -- forward (hooks._pre_forward, _root_pre_forward, _post_forward) -------------------
    def _on_pre_forward(self, unit: int) -> None:
        group = self.group_of_unit.get(unit)
        if unit == self.root_unit:
            self.reductions.finish()
            for g in self.groups:
                if g.state != "sharded":
                    self._reshard(g)
            self.order.start_iteration()
            self._forwards.start_iteration()
        self.order.record_pre_forward(unit)
        if group is not None:
            self._unshard(group)
            self._wait(group)
            if unit in self.trace.watched_inputs:
                group.inputs_pending += 1
            else:
                group.unwatched = True
        self._prefetch(self.order.next_in_forward(unit))

    def _on_post_forward(self, unit: int) -> None:
        group = self.group_of_unit.get(unit)
        self.order.record_post_forward(unit)
        if group is None or not group.frees_after_forward:
            return
        if self._forwards.finished(unit, group.index, len(group.layout.units)):
            self._reshard_after_forward(group)

    def _on_forward_end(self, _subject: int) -> None:
        pass

    # -- backward (hooks._pre_backward, _post_backward, _final_callback) --------------------
    def _on_pre_backward(self, unit: int) -> None:
        group = self.group_of_unit.get(unit)
        if group is not None and group.index not in self._reduced:
            self._unshard(group)
            self._wait(group)
        self._prefetch(self.order.prev_in_forward(unit))

    def _on_grad(self, key: int) -> None:
        group = self.group_of_param.get(key)
        if group is None:
            return
        param = next(p for p in group.layout.trainable if p.key == key)
        self.ledger.alloc(("ugrad", key), GRADIENTS,
                          param.numel * self.settings.compute_dtype.itemsize)

    def _on_inputs_ready(self, unit: int) -> None:
        group = self.group_of_unit.get(unit)
        if group is not None:
            group.inputs_pending -= 1
            group.inputs_fired += 1
            if group.index not in self._reduced and backward_is_done(
                    group.inputs_fired, group.inputs_pending, int(group.unwatched)):
                self._post_backward(group)

    def _on_backward_end(self, _subject: int) -> None:
        # the final callback: groups without a boundary signal, in the runtime's unit
        # order (the root first, then the others as found in the model)
        first = {g.index: min((0 if u == self.root_unit else u + 1) for u in g.layout.units)
                 for g in self.groups}
        for g in sorted(self.groups, key=lambda g: first[g.index]):
            if g.index not in self._reduced:
                self._post_backward(g)
        self.reductions.finish()
        for g in self.groups:
            self._reshard(g)
        self._reduced.clear()

    def _post_backward(self, group: ReplayGroup) -> None:
        self.reductions.make_room()  # Note [reductions in flight]
        self._reshard(group)  # before the reduction allocates its buffers
        self.reductions.start(group)
        self._reduced.add(group.index)

    # -- gathering (ParamGroup.unshard, wait_unshard, reshard) -------------------------------
    def _unsharded_bytes(self, group: ReplayGroup) -> int:
        return group.layout.unsharded_numel * self.settings.compute_dtype.itemsize

    def _gather_plan(self, group: ReplayGroup) -> GatherPlan:
        s = self.settings
        return gather_plan(shard_size=group.layout.shard_size, shard_dtype=s.param_dtype,
                           shard_device=s.shard_device_of(group.layout),
                           compute_dtype=s.compute_dtype, compute_device=s.device,
                           post_forward=group.post_forward_size is not None)

    def _unshard(self, group: ReplayGroup) -> None:
        s, layout = self.settings, group.layout
        if group.state == "post_forward":  # hpZ: gather the chunks straight into place
            self._hold(("unsharded", group.index), self._unsharded_bytes(group))
            group.state = "gathering"
            group.gather = ("chunk", group.index)
            return
        if group.state != "sharded":
            return
        if layout.subclass:  # Note [tensor-subclass parameters]
            n = layout.subclass_send_bytes
            if s.offloads(layout):  # the inputs are copied from the host shard first
                self.ledger.alloc(("inputs", group.index), COMMUNICATION, n)
            group.side_gather = (self.pool.take(n, torch.uint8),
                                 self.pool.take(layout.shard_size * n, torch.uint8))
            if not layout.flat:
                group.gather = None
                group.state = "gathering"
                return
        plan = self._gather_plan(group)
        if not plan.gathered:  # Note [shard groups of one rank]: no collective
            if plan.unsharded:  # otherwise the parameters are views of the shard
                self._hold(("unsharded", group.index), self._unsharded_bytes(group))
            group.gather = None  # the subclass gather, if any, is still to finish
            group.state = "gathering" if group.side_gather is not None else "unsharded"
            return
        out = self.pool.take(layout.unsharded_numel, s.compute_dtype)  # a cast lands in it
        if s.quantize_weights:  # Note [quantized communication]: the int8 shard and all of them
            per_rank = wire_bytes(layout.shard_numel, s.quantize_weights)
            self.ledger.alloc(("q_gather", group.index), COMMUNICATION,
                              (1 + layout.shard_size) * per_rank)
        group.gather = out
        group.state = "gathering"

    def _wait(self, group: ReplayGroup) -> None:
        if group.state != "gathering":
            return
        if group.side_gather is not None:
            self._hold(("side", group.index),
                       group.layout.shard_size * group.layout.subclass_send_bytes)
            self._sample()  # copy-out: received and outputs both alive
            self._give_side_gather(group)
        if group.gather is None:
            pass
        elif group.gather == ("chunk", group.index):
            self._sample()
            self.ledger.free(("chunk", group.index))
        else:
            out = group.gather  # a pool handle
            self._hold(("unsharded", group.index), self._unsharded_bytes(group))
            if self.ledger.holds(("q_gather", group.index)):  # dequantized a pass at a time
                self._sample_with(min(ROWS_PER_PASS, group.layout.shard_size)
                                  * group.layout.shard_numel * 4)
            self._sample()  # copy-out: gathered and unsharded both alive
            self.pool.give(out)
            self._free_quantized_gather(group)
        group.gather = None
        group.state = "unsharded"

    def _free_quantized_gather(self, group: ReplayGroup) -> None:
        if self.ledger.holds(("q_gather", group.index)):
            self.ledger.free(("q_gather", group.index))

    def _hold(self, key: tuple, nbytes: int) -> None:
        """Gathered parameters' storage: allocated unless kept from the last gather."""
        if not self.ledger.holds(key):
            self.ledger.alloc(key, UNSHARDED, nbytes)

    def _give_side_gather(self, group: ReplayGroup) -> None:
        send, received = group.side_gather
        self.pool.give(send)
        self.pool.give(received)
        group.side_gather = None
        if self.ledger.holds(("inputs", group.index)):
            self.ledger.free(("inputs", group.index))

    def _prefetch(self, group: ReplayGroup | None) -> None:
        if group is not None and group.state == "sharded" and group.index not in self._reduced:
            self._unshard(group)

    def _reshard_after_forward(self, group: ReplayGroup) -> None:
        n = group.post_forward_size
        if n is None or group.state != "unsharded":
            self._reshard(group)
            return
        # hpZ: keep 1/N (Note [resharding after forward to a smaller group])
        self.ledger.alloc(("chunk", group.index), UNSHARDED, self._unsharded_bytes(group) // n)
        self._sample()
        self._reshard(group)
        group.state = "post_forward"

    def _reshard(self, group: ReplayGroup) -> None:
        if group.state == "sharded":
            return
        if group.state == "post_forward":
            self.ledger.free(("chunk", group.index))
        elif group.state == "gathering":  # never drop a buffer under a live collective
            if group.side_gather is not None:
                self._give_side_gather(group)
            if group.gather is None:
                pass
            elif group.gather == ("chunk", group.index):
                self.ledger.free(("chunk", group.index))
            else:
                self.pool.give(group.gather)
                self._free_quantized_gather(group)
            group.gather = None
        if not self.settings.keep_unsharded:
            for key in (("unsharded", group.index), ("side", group.index)):
                if self.ledger.holds(key):
                    self.ledger.free(key)
        group.state = "sharded"

    # -- optimizer --------------------------------------------------------------------
    def _optimizer_step(self) -> None:
        s = self.settings
        shards = [p.shard_numel(g.layout.shard_size) * s.param_dtype.itemsize
                  for g in self.groups for p in g.layout.trainable
                  if p.key not in s.whole_matrix and not s.offloads(g.layout)]
        # Note [whole-matrix optimizers], "In rounds": at most the next round's gather
        # (its send and receive), this round's whole gradient and the previous round's
        # send are alive: four of the largest matrix. The rows coming back replace the
        # rows as last written, which the step no longer needs once it compared them.
        whole = 4 * self.largest_whole * s.param_dtype.itemsize
        if not shards or not s.optimizer_states:
            temporaries = 0  # all offloaded: the step runs on the host
        elif s.foreach_optimizer:
            temporaries = sum(shards)      # e.g. _foreach_sqrt of every second moment
        else:
            temporaries = 2 * max(shards)  # one parameter's sqrt(v) and its quotient
        if whole and not s.offload:
            # One optimizer steps after the other.
            temporaries = max(temporaries, whole)
        self._sample(extra=temporaries)
        for g in self.groups:  # zero_grad(set_to_none=True): fresh gradients die
            if not g.persistent_grads and self.ledger.holds(("grad", g.index)):
                self.ledger.free(("grad", g.index))
