"""HostCopies: the device<->host copies of CPU offload on their own CUDA streams.

Note [streams and events]
On CUDA a unit's collectives are issued with ``async_op=True``: the process group
runs them on its own NCCL stream after waiting for the current stream, and
``work.wait()`` makes the current stream wait for them, so the next unit's
all-gather overlaps this unit's compute and a reduce-scatter overlaps the next
unit's backward without fullshard owning a communication stream. Buffers a
collective uses are freed (or returned to the pool) only after ``wait()``, which
orders every later use on the current stream after the collective: no
``record_stream``.

CPU offload adds copies between pinned host memory and the device, and a copy on
the compute stream would stall compute for its whole duration (a gradient copied
to the host synchronously also blocks the Python thread until the backward queued
so far has run: 4x FSDP2's offload step time on an H100). So:

* device -> host (reduced gradient shards): on the ``to_host`` stream, after it
  waits for the current stream (the reduction is complete there); the copy is
  non-blocking into pinned memory and an event marks its end. The source stays
  referenced here until that event has passed (checked without waiting at each new
  copy), so its memory cannot be reused while the copy reads it: what
  ``record_stream`` would do, without delaying every free on that stream. ``settle()`` synchronizes on the events: at the end of
  backward, before the optimizer steps on the host gradients, as FSDP2 does.
* host -> device (the shard before its all-gather): on the ``to_device`` stream,
  which waits for the current stream first (the pooled destination may still be
  read there), and the all-gather is issued on that stream so NCCL orders itself
  after the copy while compute goes on. Every gather runs there, offloaded or not,
  and so does the copy-in of a shard group of one rank (no collective: the copy alone).

The copy stream's blocks. Blocks the caching allocator hands out on the copy stream
(the gather's send and receive buffers) are read afterwards on a compute stream (the
copy-out into the unsharded parameters, the int8 gather's dequantizing) and then go
back to the pool or, when the pool does not keep them, to the allocator, which hands
a freed block to the next allocation *on the stream it was made on* without waiting
for other streams. So the rule: every buffer read on a compute stream after the copy
stream made it is followed there by ``reads_done()``, which records an event on that
compute stream, and the copy stream waits on the latest such event of every compute
stream before it allocates again (``to_device``). Waiting for the caller's stream alone
is not enough: with ``share_comm_ctx`` the stages of a pipeline share one copy stream
from different compute streams, and stage B's gather could reuse a block stage A is
still copying out of. (FSDP2 does the same with an event recorded after its copy-out.)

Without CUDA every method is the plain synchronous copy, so the CPU test suite runs
the same code paths. The profiler sees each copy as a ``fullshard::`` range
(``traced``).
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.profiler import record_function

from .collectives import Pending


def _unchanged(pending: Pending) -> Pending:
    return pending


def traced(name: str, unit: str | None = None):
    """A ``fullshard::NAME [UNIT]`` range for torch.profiler; nothing, not even the name's
    formatting, when no profiler runs (small units open several ranges per step)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return record_function(f"fullshard::{name}" + (f" {unit}" if unit else ""))
    return contextlib.nullcontext()


class HostCopies:
    """The copy streams of one root's units (Note [streams and events]). ``streams`` is
    the device's module of streams and events (``torch.cuda``; tests pass a recording
    stand-in); without one every method is the plain synchronous copy."""

    def __init__(self, device: torch.device, streams=None):
        self.device = device
        self._streams = streams if streams is not None else (
            torch.cuda if device.type == "cuda" else None)
        self._to_host = self._streams.Stream(device) if self._streams else None
        self._to_device = self._streams.Stream(device) if self._streams else None
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        # the latest reads_done() event of each compute stream, not yet waited for
        self._reads: dict = {}

    def reads_done(self) -> None:
        """The current stream has queued its last read of buffers the copy stream made
        (a gather's copy-out or dequantizing): the copy stream allocates again only
        after it (Note [streams and events])."""
        if self._streams is None:
            return
        caller = self._streams.current_stream(self.device)
        self._reads[caller] = caller.record_event()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (device) into ``dst`` (pinned host memory) without blocking; the
        values are readable after ``settle()``."""
        with traced("copy_to_host"):
            if self._streams is None or src.device.type == "cpu":
                dst.copy_(src)
                return
            self._release_landed()
            stream = self._to_host
            stream.wait_stream(self._streams.current_stream(self.device))
            with self._streams.stream(stream):
                dst.copy_(src, non_blocking=True)
                done = stream.record_event()
            self._in_flight.append((done, src))

    @contextlib.contextmanager
    def to_device(self):
        """Run host -> device copies and the collective that sends their result on the
        copy stream, ordered after the current stream's earlier work. Yields
        ``ordered(pending)``, which makes waiting on the collective also order the
        waiting stream after the copy stream (a custom collective may return no work)."""
        if self._streams is None:
            yield _unchanged
            return
        streams = self._streams
        stream = self._to_device
        stream.wait_stream(streams.current_stream(self.device))
        for read in self._reads.values():  # blocks freed after reads on other streams
            stream.wait_event(read)
        self._reads.clear()

        def ordered(pending: Pending) -> Pending:
            issued = stream.record_event()
            earlier = pending.finish

            def finish() -> None:
                streams.current_stream(self.device).wait_event(issued)
                if earlier is not None:
                    earlier()
            return pending._replace(finish=finish)

        with streams.stream(stream):
            yield ordered

    def _release_landed(self) -> None:
        """Let go of the sources of copies already done (no waiting): a backward's
        reduced shards would otherwise stay on the device until it ends."""
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.pop(0)

    def settle(self) -> None:
        """Wait until every copy to the host has landed, then let go of the sources."""
        if not self._in_flight:
            return
        with traced("wait_for_host_copies"):
            for done, _src in self._in_flight:
                done.synchronize()
            self._in_flight.clear()


class SharedCopies:
    """One set of copy streams for several roots (torch's ``share_comm_ctx``, e.g. the
    stages of a pipeline): blocks the caching allocator hands out on a stream are reused
    only on that stream, so roots with streams of their own would each keep memory."""

    def __init__(self):
        self._copies: HostCopies | None = None

    def for_device(self, device: torch.device) -> HostCopies:
        if self._copies is None:
            self._copies = HostCopies(device)
        return self._copies
