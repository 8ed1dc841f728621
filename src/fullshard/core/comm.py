"""What travels: collectives between ranks, the buffers they reuse, and CPU offload's
copies between host and device on their own streams.

* Collectives (``all_gather``, ``reduce_scatter_sum``, ``all_reduce_sum``) are
  stateless: each takes tensors and a process group and returns a ``Pending``; none of
  them reads module state. ``async_op=True`` returns before the data has arrived so the
  caller can overlap the collective with compute and ``wait()`` later.
* ``BufferPool`` keeps the communication buffers of one root across steps.
* ``HostCopies`` runs CPU offload's device<->host copies on CUDA streams of their own.
* ``note_collective`` / ``settle_before_exit``: the collective threads finish before the
  interpreter does.

Note [collectives are always issued async]
Blocking calls are issued with async_op=True and waited at once: the cost is the
same and one code path serves both.

Note [reduce-scatter on gloo]
gloo's reduce_scatter is slow (measured at world size 2: 3.5 ms for 50K floats
where all_to_all plus a local sum takes 0.33 ms; 1.7-3.7x at world size 4 up to 4M
floats). On gloo we exchange the chunks with one all_to_all and sum the world_size
received copies of our chunk locally; other backends use their native reduce-scatter.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import re
import time
import weakref
from typing import Callable, Generic, Hashable, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function


# -- collectives settle before exit -----------------------------------------------------------
# Note [collectives settle before exit]
# A gloo collective runs on one of the process group's worker threads, which drops its
# reference to the work (and so to the tensors the work holds) a moment after the work
# completes. When Python has already let go of such a tensor, its Python object is kept
# alive by the tensor and released by that thread, which must then take the GIL. If the
# interpreter is finalizing by then, a thread taking the GIL is ended on the spot, inside
# a C++ destructor, and the process aborts: "terminate called without an active
# exception" (SIGABRT). A program whose last fullshard collective runs just before it
# ends (a unit's forward called alone, an evaluation step, a gather of the last
# parameters) hit this in 3 of 72 runs at 2 ranks, and in none of 120 with the wait
# below. Every collective fullshard issues or waits notes the time (its gathers and
# reductions, the divergence guard's exchanges, clipping's norm, a whole-matrix step's
# exchanges, checkpoints' collectives); at exit, while the interpreter is still whole,
# fullshard waits until GRACE_S has passed since the last one, so the threads finish
# first. A program that ends later than that waits for nothing.

GRACE_S = 0.1  # the worker drops its reference microseconds after completing the work

# When fullshard last issued or waited on a collective, and whether the exit handler is
# registered: process-wide, because the interpreter's exit is.
_last: float | None = None
_registered = False


# Note [one seam for observing collectives]
# Tools that count fullshard's collectives (fullshard.testing.counting) register an
# observer here rather than patching the collective functions where other modules
# imported them: a new or renamed import site would silently count nothing. Every
# collective fullshard issues on its data (all-gathers, reduce-scatters, all-reduces,
# quantized or not) tells the observers its kind and group as it is issued; collectives
# a group of one rank skips are not issued and not told. Outside such tools the list is
# empty: one test per collective.
_OBSERVERS: list[Callable[[str, dist.ProcessGroup, bool], None]] = []


@contextlib.contextmanager
def observing(observer: Callable[[str, dist.ProcessGroup, bool], None]):
    """Call ``observer(kind, group, async_op)`` for each collective issued inside the block;
    ``kind`` is ``all_gather``, ``reduce_scatter`` or ``all_reduce``."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def issued(kind: str, group: dist.ProcessGroup, async_op: bool) -> None:
    """Tell the observers a collective is being issued (Note [one seam for observing
    collectives])."""
    _COMMUNICATED.add(group)
    for observer in _OBSERVERS:
        observer(kind, group, async_op)


# Note [groups left with a collective that cannot finish]
# After ranks diverged (DivergenceError) or a collective failed between them
# (CollectiveError), a collective this rank issued may wait for a peer that issued another
# one and never will. A program may catch the error and end; but gloo's process group,
# when destroyed, joins its worker threads, and the worker waits for that collective until
# the group's timeout (30 minutes by default). The group is destroyed at the interpreter's
# very end (DTensor's caches hold it), so the program would hang there, with no Python
# frame, with or without ``destroy_process_group()``. From the moment such an error is
# made, fullshard keeps every process group it communicated on (and the default one)
# alive for the rest of the process: one reference that is never released, so no
# destructor waits and the process ends with its own exit status (the operating system
# closes the sockets). Nothing else changes: a collective the program issues on those
# groups afterwards meets the unfinished ones, as it would have without fullshard.
_COMMUNICATED: "weakref.WeakSet[dist.ProcessGroup]" = weakref.WeakSet()
_KEPT: set[int] = set()


def communicates_on(group: dist.ProcessGroup) -> None:
    """Count ``group`` among those fullshard communicates on (one made for fullshard's own
    messages; the data collectives are counted as they are issued)."""
    _COMMUNICATED.add(group)


def keep_groups_past_exit() -> None:
    """Note [groups left with a collective that cannot finish]."""
    groups = list(_COMMUNICATED)
    if dist.is_initialized():
        groups.append(dist.group.WORLD)
    for group in groups:
        if id(group) not in _KEPT:
            _KEPT.add(id(group))
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never released


def note_collective() -> None:
    """Record that a collective was issued or waited on now (cheap: one clock read)."""
    global _last, _registered
    _last = time.monotonic()
    if not _registered:
        atexit.register(settle_before_exit)
        _registered = True


def settle_before_exit() -> float:
    """Wait out the rest of GRACE_S since the last collective; returns the seconds waited."""
    if _last is None:
        return 0.0
    left = GRACE_S - (time.monotonic() - _last)
    if left > 0:
        time.sleep(left)  # releases the GIL: a worker that needs it takes it now
    return max(left, 0.0)


# -- collectives ------------------------------------------------------------------------------
# torch 2.13 and 2.15 name the flat collectives *_single; older releases (2.11) only have
# the *_into_tensor / *_tensor spellings (same semantics).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Whether a group of one rank skips its collectives (Note [shard groups of one rank] in
# core/group.py). Process-wide because the choice must be the same for every group and
# for the memory estimate's replay of them; only fullshard.testing's
# ``collectives_at_one_rank`` turns it off (the CUDA lane and the GPU benchmark on one GPU).
_ONE_RANK_SHORTCUTS = True


def skips_collectives(size: int) -> bool:
    """Whether a group of ``size`` ranks copies instead of communicating: one rank, unless
    the one-rank shortcuts were turned off (``fullshard.testing.collectives_at_one_rank``)."""
    return size == 1 and _ONE_RANK_SHORTCUTS


def set_one_rank_shortcuts(enabled: bool) -> bool:
    """Turn the one-rank shortcuts on or off, before the process shards anything (a group
    follows the setting in force whenever it acts); returns the previous setting. See
    ``fullshard.testing.collectives_at_one_rank``."""
    global _ONE_RANK_SHORTCUTS
    previous, _ONE_RANK_SHORTCUTS = _ONE_RANK_SHORTCUTS, bool(enabled)
    return previous


class CollectiveError(RuntimeError):
    """A fullshard collective failed or timed out; the message names the unit."""

    def __init__(self, *args):
        super().__init__(*args)
        keep_groups_past_exit()  # Note [groups left with a collective that cannot finish]


# What a collective's failure says when the ranks, not this one, are the cause: a timeout,
# a peer gone, buffers of different sizes. Anything else (an error raised on this rank
# alone) is reported as it is, without guessing at diverged ranks.
_BETWEEN_RANKS = re.compile(r"timed? ?out|connection|peer|closed|reset|abort|broken pipe|"
                            r"mismatch|size", re.IGNORECASE)


def _failure(what: str, err: RuntimeError) -> CollectiveError:
    text = f"fullshard: {what} failed on rank {dist.get_rank()}: {err}"
    if isinstance(err, dist.DistError) or _BETWEEN_RANKS.search(str(err)):
        text += (". If it timed out or a peer went away, ranks probably took different paths "
                 "(a forward or backward on some ranks only, a layer skipped on one rank, a "
                 "rank that stopped early); run with FULLSHARD_DEBUG=1 to find where they "
                 "diverged.")
    return CollectiveError(text)


class Pending(NamedTuple):
    """A collective in flight; ``wait()`` returns its output once it has arrived."""

    output: torch.Tensor
    work: dist.Work | None
    finish: Callable[[], None] | None = None  # local work after the data arrived

    def wait(self, what: str = "a fullshard collective", patience=None) -> torch.Tensor:
        """Wait for the data; ``what`` ("all-gather of layers.3") names it in errors.

        ``patience`` (an object with ``stall_slice``, a timedelta, and ``stalled(what)``)
        makes a wait that blocks the host (gloo) wait in slices and call
        ``patience.stalled(what)`` after each, which may raise (Note [ranks agree on every
        collective] in core/guard/divergence.py); the collective itself is never abandoned."""
        if self.work is not None and patience is not None:
            _wait_in_slices(self.work, what, patience)
        elif self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as err:
                raise _failure(what, err) from err
            note_collective()  # Note [collectives settle before exit]
        if self.finish is not None:
            self.finish()
        return self.output


def _wait_in_slices(work: dist.Work, what: str, patience) -> None:
    while True:
        try:
            work.wait(timeout=patience.stall_slice)
            return
        except RuntimeError as err:
            if _NO_FINITE_WAIT.search(str(err)):  # a Work that cannot wait in slices
                Pending(None, work).wait(what)
                return
            if work.is_completed():  # the collective itself failed (a peer, its timeout)
                raise _failure(what, err) from err
        patience.stalled(what)  # raises when the ranks diverged; else wait on


# Works that wrap a future (a process group behind a wrapper, e.g. torch's test harness's)
# refuse wait(timeout=): those are waited whole, as without a guard.
_NO_FINITE_WAIT = re.compile(r"finite timeout not implemented", re.IGNORECASE)


def _done(pending: Pending, async_op: bool, what: str, patience=None) -> Pending:
    note_collective()  # issued: Note [collectives settle before exit]
    return pending if async_op else Pending(pending.wait(what, patience), None)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
               async_op: bool = False, what: str = "an all-gather",
               patience=None) -> Pending:
    """Gather every rank's equal-sized ``shard`` into ``output`` (rank-major). ``what``
    and ``patience`` are as in ``Pending.wait`` (a blocking call waits with them)."""
    if skips_collectives(group.size()):
        output.copy_(shard)
        return Pending(output, None)
    if _OBSERVERS:
        issued("all_gather", group, async_op)
    work = _all_gather_flat(output, shard, group=group, async_op=True)
    return _done(Pending(output, work), async_op, what, patience)


def receives_into_scratch(backend: str, size: int) -> bool:
    """Whether ``reduce_scatter_sum`` over ``size`` ranks on ``backend`` uses a scratch
    buffer the size of ``full`` (gloo receives every rank's copy of this rank's chunk,
    Note [reduce-scatter on gloo])."""
    return not skips_collectives(size) and backend == "gloo"


def reduce_scatter_sum(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                       async_op: bool = False, scratch: torch.Tensor | None = None,
                       what: str = "a reduce-scatter", inspect=None) -> Pending:
    """Sum ``full`` (rank-major chunks) over ranks; this rank's chunk lands in ``output``.
    ``scratch`` (``full``-sized, see ``receives_into_scratch``) is used and may be reused after.
    ``inspect(rows)``, where the sum is taken on this rank (gloo), is called with every
    rank's copy of this rank's chunk (one row each) before they are summed."""
    if skips_collectives(group.size()):
        output.copy_(full)
        return Pending(output, None)
    if _OBSERVERS:
        issued("reduce_scatter", group, async_op)
    if dist.get_backend(group) == "gloo":
        received = scratch if scratch is not None else torch.empty_like(full)
        return _done(_reduce_scatter_by_all_to_all(output, full, received, group, inspect),
                     async_op, what)
    work = _reduce_scatter_flat(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _done(Pending(output, work), async_op, what)


def _reduce_scatter_by_all_to_all(output: torch.Tensor, full: torch.Tensor,
                                  received: torch.Tensor, group: dist.ProcessGroup,
                                  inspect=None) -> Pending:
    """See Note [reduce-scatter on gloo]."""
    work = dist.all_to_all_single(received, full, group=group, async_op=True)

    def sum_copies() -> None:
        if inspect is not None:
            inspect(received.view(group.size(), -1))
        torch.sum(received.view(group.size(), -1), dim=0, out=output)

    return Pending(output, work, sum_copies)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup,
                   async_op: bool = False, what: str = "an all-reduce") -> Pending:
    """Sum ``tensor`` in place over ``group`` (the reduction across replicas)."""
    if skips_collectives(group.size()):
        return Pending(tensor, None)
    if _OBSERVERS:
        issued("all_reduce", group, async_op)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _done(Pending(tensor, work), async_op, what)


# -- the buffer pool --------------------------------------------------------------------------
# Note [which buffers are pooled]
# Every step moves the same groups through the same collectives, so the gather
# output, the gradient send buffer and gloo's receive buffer have the same sizes
# step after step. Buffers up to ``max_numel`` elements are kept when released and
# handed out again for the same (size, dtype, device): after the first step no new
# communication buffer is allocated. Larger buffers are not kept: holding a large
# group's idle buffers while another group computes would raise the peak memory
# that sharding exists to lower (on CUDA the caching allocator reuses them anyway;
# on CPU they go back to the system between uses). At most ``max_per_key`` idle
# buffers are kept per key, which covers a group in use plus one prefetched.

DEFAULT_MAX_NUMEL = 4 << 20  # 16 MiB of fp32

B = TypeVar("B")


class FreeLists(Generic[B]):
    """Idle buffers by key, kept under the pool's rule (Note [which buffers are pooled]).
    What a buffer is and how it is made is the caller's: BufferPool holds tensors, the
    memory estimator (memory/replay.py) byte counts."""

    def __init__(self, max_numel: int = DEFAULT_MAX_NUMEL, max_per_key: int = 2):
        self.max_numel = max_numel
        self.max_per_key = max_per_key
        self._free: dict[Hashable, list[B]] = {}

    def keeps(self, numel: int) -> bool:
        """Whether buffers of ``numel`` elements are pooled at all (also the size up to
        which a group keeps persistent sharded gradients, Note [persistent sharded
        gradients])."""
        return numel <= self.max_numel

    def pop(self, key: Hashable) -> B | None:
        """An idle buffer for ``key``, or None."""
        free = self._free.get(key)
        return free.pop() if free else None

    def push(self, key: Hashable, numel: int, buf: B) -> bool:
        """Keep ``buf`` (no longer in use) for ``key``; False if the rule drops it."""
        if not self.keeps(numel):
            return False
        free = self._free.setdefault(key, [])
        if len(free) >= self.max_per_key:
            return False
        free.append(buf)
        return True

    def idle(self) -> list[B]:
        return [b for free in self._free.values() for b in free]


class BufferPool(FreeLists[torch.Tensor]):
    """Free lists of flat buffers keyed by (numel, dtype, device)."""

    def __init__(self, max_numel: int = DEFAULT_MAX_NUMEL, max_per_key: int = 2):
        super().__init__(max_numel, max_per_key)
        self.allocations = 0  # buffers created (pool misses and unpooled sizes)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.pop((numel, dtype, device))
        if buf is None:
            self.allocations += 1
            buf = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def idle_bytes(self) -> int:
        """Bytes held in the free lists (read-only accounting for fullshard.memory)."""
        return sum(b.numel() * b.element_size() for b in self.idle())

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer taken from this pool; it must no longer be in use."""
        self.push((buf.numel(), buf.dtype, buf.device), buf.numel(), buf)


# -- host copies on streams -------------------------------------------------------------------
# Note [streams and events]
# On CUDA a unit's collectives are issued with ``async_op=True``: the process group
# runs them on its own NCCL stream after waiting for the current stream, and
# ``work.wait()`` makes the current stream wait for them, so the next unit's
# all-gather overlaps this unit's compute and a reduce-scatter overlaps the next
# unit's backward without fullshard owning a communication stream. Buffers a
# collective uses are freed (or returned to the pool) only after ``wait()``, which
# orders every later use on the current stream after the collective: no
# ``record_stream``.
#
# CPU offload adds copies between pinned host memory and the device, and a copy on
# the compute stream would stall compute for its whole duration (a gradient copied
# to the host synchronously also blocks the Python thread until the backward queued
# so far has run: 4x FSDP2's offload step time on an H100). So:
#
# * device -> host (reduced gradient shards): on the ``to_host`` stream, after it
#   waits for the current stream (the reduction is complete there); the copy is
#   non-blocking into pinned memory and an event marks its end. The source stays
#   referenced here until that event has passed (checked without waiting at each new
#   copy), so its memory cannot be reused while the copy reads it: what
#   ``record_stream`` would do, without delaying every free on that stream. ``settle()``
#   synchronizes on the events: at the end of backward, before the optimizer steps on
#   the host gradients, as FSDP2 does.
# * host -> device (the shard before its all-gather): on the ``to_device`` stream,
#   which waits for the current stream first (the pooled destination may still be
#   read there), and the all-gather is issued on that stream so NCCL orders itself
#   after the copy while compute goes on. Every gather runs there, offloaded or not,
#   and so does the copy-in of a shard group of one rank (no collective: the copy alone).
#
# The copy stream's blocks. Blocks the caching allocator hands out on the copy stream
# (the gather's send and receive buffers) are read afterwards on a compute stream (the
# copy-out into the unsharded parameters, the int8 gather's dequantizing) and then go
# back to the pool or, when the pool does not keep them, to the allocator, which hands
# a freed block to the next allocation *on the stream it was made on* without waiting
# for other streams. So the rule: every buffer read on a compute stream after the copy
# stream made it is followed there by ``reads_done()``, which records an event on that
# compute stream, and the copy stream waits on the latest such event of every compute
# stream before it allocates again (``to_device``). Waiting for the caller's stream alone
# is not enough: with ``share_comm_ctx`` the stages of a pipeline share one copy stream
# from different compute streams, and stage B's gather could reuse a block stage A is
# still copying out of. (FSDP2 does the same with an event recorded after its copy-out.)
#
# Without CUDA every method is the plain synchronous copy, so the CPU test suite runs
# the same code paths. The profiler sees each copy as a ``fullshard::`` range
# (``traced``).

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

    def forget_reads(self) -> None:
        """Drop the compute streams' read events once the device has finished them (the
        caller synchronized): a CUDA graph's capture may not wait on an event recorded
        before it began (Note [capturing the steady step] in captured/)."""
        self._reads.clear()

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

    @property
    def in_flight(self) -> bool:
        """Whether copies to the host are still to land (``settle`` would wait)."""
        return bool(self._in_flight)

    def landed(self):
        """An event that completes when every copy to the host queued so far has landed
        (they run in order on one stream); None when none is in flight or copies are
        synchronous. Another thread may wait on it (``synchronize``)."""
        return self._in_flight[-1][0] if self._in_flight else None

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
