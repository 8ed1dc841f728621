"""The gradient side of a replayed step (memory/replay.py) in byte counts: what
``GradReduction.reduce`` allocates for a group's reduction (the pooled send buffer, the
gloo scratch, a separate output, int8 chunks) and what ``PendingReduce.finish`` gives
back, with as many reductions in flight as at run time (Note [reductions in flight])."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..core.features.quantized_collectives import ROWS_PER_PASS, wire_bytes
from ..core.schedule import ReducePlan, reduce_plan
from .byte_ledger import COMMUNICATION, GRADIENTS, BytePool, ByteLedger

if TYPE_CHECKING:
    from .run_settings import ReplayGroup, RunSettings


class ReductionReplay:
    """One replayed step's reductions; ``sample`` records the total alive now and
    ``sample_with(n)`` the same with a temporary of ``n`` bytes."""

    def __init__(self, settings: "RunSettings", ledger: ByteLedger, pool: BytePool,
                 sample: Callable[[], None], sample_with: Callable[[int], None]):
        self.settings = settings
        self.ledger = ledger
        self.pool = pool
        self.sample = sample
        self.sample_with = sample_with
        # (group, send buffer, scratch, output) of each reduction in flight, oldest first
        self.pending: list[tuple] = []

    def start(self, group: "ReplayGroup") -> None:
        """Reduce ``group``'s gradients (``make_room`` ran first)."""
        reduction = self._reduce(group)
        if reduction is not None:
            self.pending.append(reduction)

    def make_room(self) -> None:
        """Before a reduction starts: finish the oldest ones beyond those the runtime leaves
        in flight (``RootState.finish_pending_reduce(everything=False)``)."""
        self.finish(keep=self.settings.reduces_in_flight - 1)

    def _reduce(self, group: "ReplayGroup") -> tuple | None:
        s, layout = self.settings, group.layout
        if not layout.trainable:
            return None
        w, numel = layout.shard_size, layout.reduce_numel
        full = self.pool.take(w * numel, s.reduce_dtype)
        self.sample()  # the unsharded gradients are copied into ``full``, then freed
        for p in layout.trainable:
            if self.ledger.holds(("ugrad", p.key)):
                self.ledger.free(("ugrad", p.key))
        self._grad_destination(group)
        plan = self._plan(group)
        if plan.all_reduce:  # all-reduced in ``full``, then copied over
            self.sample()
            return group, full, None, None
        quantized = s.quantize_grads and w > 1  # Note [quantized communication]
        scratch = self.pool.take(w * numel, s.reduce_dtype) \
            if plan.scratch and not quantized else None
        out = None
        if plan.output:
            out = ("out", group.index)
            self.ledger.alloc(out, COMMUNICATION, numel * s.reduce_dtype.itemsize)
        if quantized:  # int8 chunks to send and as many received, until the sum
            per_rank = wire_bytes(numel - len(layout.trainable), s.quantize_grads) \
                + 4 * len(layout.trainable)
            self.ledger.alloc(("q_reduce", group.index), COMMUNICATION, 2 * w * per_rank)
        self.sample()
        return group, full, scratch, out

    def _grad_destination(self, group: "ReplayGroup") -> None:
        """Note [persistent sharded gradients]: small groups keep one gradient buffer,
        allocated by their first reduction; larger ones get fresh gradients."""
        s, numel = self.settings, group.layout.reduce_numel
        group.persistent_grads = self.pool.keeps(numel)
        if not self.ledger.holds(("grad", group.index)):
            nbytes = numel * s.param_dtype.itemsize
            on_host = s.offloads(group.layout)
            self.ledger.alloc(("grad", group.index), GRADIENTS,
                              s.host_buffer_bytes(nbytes) if on_host else nbytes, on_host)

    def _plan(self, group: "ReplayGroup") -> ReducePlan:
        s = self.settings
        return reduce_plan(shard_size=group.layout.shard_size, replicated=s.replicated,
                           backend=s.backend, reduce_dtype=s.reduce_dtype,
                           compute_device=s.device, grad_dtype=s.param_dtype,
                           grad_device=s.shard_device_of(group.layout))

    def finish(self, keep: int = 0) -> None:
        """Finish reductions in flight, oldest first, until ``keep`` are left."""
        while len(self.pending) > keep:
            self._finish_one(self.pending.pop(0))

    def _finish_one(self, pending: tuple) -> None:
        """One reduction finished: its buffers go back or die."""
        group, full, scratch, out = pending
        if self.ledger.holds(("q_reduce", group.index)):  # fp32 sum, a pass of rows
            numel = group.layout.reduce_numel
            self.sample_with((1 + min(ROWS_PER_PASS, group.layout.shard_size)) * numel * 4)
        self.pool.give(full)
        self.pool.give(scratch)
        if out is not None:
            self.ledger.free(out)
        if self.ledger.holds(("q_reduce", group.index)):
            self.ledger.free(("q_reduce", group.index))
