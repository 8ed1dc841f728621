"""The gradient side of a group: taking unsharded gradients, reducing them.

``GradReduction.reduce`` lays a group's gradients out and starts the reduce-scatter;
``PendingReduce`` completes it: replica all-reduce under hybrid sharding, the mean,
the cast back into the parameters' dtype, and handing the shards out as ``.grad``.

Note [a reduction's chunk]
A group's gradients are reduced in one collective whose send buffer is laid out rank
major: rank r's chunk is what rank r receives summed. Every chunk is

    [ gradient shard of each trainable parameter, in the group's order ]
    [ one presence flag per trainable parameter ]   Note [gradient presence flags]
    [ DIGEST_NUMEL elements of the sender's ledger digest ]   Note [ranks agree on every collective]

The flags and the digest ride in the same collective so that neither costs one of its
own: the flags tell every rank which parameters got a gradient anywhere, and on gloo
(whose reduce-scatter receives every rank's copy of a chunk before summing them) the
digests let every rank compare what the ranks ran before the sum is used. Each digest
element carries 8 bits, exact in any floating dtype. Everything that writes or reads a
chunk (packing, handing gradients out, the guard's inspection, quantized reductions
that must carry the tail exactly, the memory replay that sizes the buffers) goes
through the functions below, so the layout is stated once; the digest's encoding in
elements sits with the digest (core/guard/ledger.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist

from .comm import (BufferPool, HostCopies, Pending, all_reduce_sum, reduce_scatter_sum,
                   skips_collectives, traced)
from .features import grad_norms
from .features.grad_dtype import accumulation_dtypes, sharded_grad_dtypes
from .guard.divergence import Guard
from .guard.ledger import DIGEST_NUMEL, REDUCE_SCATTER_OWN_GROUP, digest_elements
from .param import ShardedParam
from .features.quantized_collectives import quantized_reduce_scatter_sum
from .schedule import reduce_plan


def chunk_tail_numel(params: int) -> int:
    """Elements after the gradients in a chunk: presence flags, then the digest."""
    return params + DIGEST_NUMEL


def chunk_numel(shard_numels: Sequence[int]) -> int:
    """Elements of one rank's chunk for trainable shards of ``shard_numels`` elements."""
    return sum(shard_numels) + chunk_tail_numel(len(shard_numels))


def split_chunk(chunk: torch.Tensor, shard_numels: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Views of a chunk: each parameter's gradient shard, then the flags, then the digest
    (the last two are ``parts[-2]`` and ``parts[-1]``)."""
    return torch.split(chunk, list(shard_numels) + [len(shard_numels), DIGEST_NUMEL])


def chunk_gradients(chunk: torch.Tensor, params: int) -> torch.Tensor:
    """The gradient part of a chunk (what a communication hook sees)."""
    return chunk[:chunk.numel() - chunk_tail_numel(params)]


def received_digests(rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """Every sender's digest in the copies of one chunk a rank received (one row each,
    ``chunk`` elements of a chunk at the start of each row): what the guard inspects."""
    return rows[:, chunk - DIGEST_NUMEL:chunk]


# Note [dividing fp16 gradients before and after the sum]
# The mean gradient is the sum over the data-parallel ranks divided by their number N.
# In fp32 and bf16 the sum cannot overflow (bf16 has fp32's range), so the division comes
# after it, once, on the smaller reduced shard. fp16 tops out at 65,504: 1,024 ranks'
# gradients of 64 each (a GradScaler scales them up by 2**16 and more) sum to inf, and the
# scaler then skips every step while halving its scale. So in fp16 (any dtype but those
# two) each rank divides its gradients by a power of two near sqrt(N) before the sum and
# the sum by the rest after it, as torch's FSDP2 does: the gradients stay within range and
# above the subnormals on both sides. Only the gradients are divided before the sum; the
# presence flags and the digest in the chunk's tail must arrive exact.
def divide_factors(reduce_dtype: torch.dtype, divide_factor: float | None,
                   data_parallel_size: int) -> tuple[float, float]:
    """(before, after): what the gradients are divided by before and after the sum
    (Note [dividing fp16 gradients before and after the sum]); before * after is
    ``divide_factor`` (``set_gradient_divide_factor``), else the data-parallel size."""
    factor = divide_factor or data_parallel_size
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return 1.0, factor
    before = 1
    while factor % before == 0 and factor / before > before:
        before *= 2
    return float(before), factor / before


def take_unsharded_grad(p: ShardedParam) -> torch.Tensor | None:
    """This backward's unsharded gradient plus any accumulated without sync, or None."""
    grad, acc = p.local_grad(p.unsharded_param.grad), p.accumulated_grad
    p.accumulated_grad = None
    if acc is None:
        return grad
    return acc if grad is None else acc.add_(grad)


@dataclass(frozen=True)
class ReduceOptions:
    """How a group's reduced gradients are finished (torch's FSDPModule setters).

    divide_factor: divide the summed gradients by this instead of the data-parallel size.
    all_reduce: under hybrid sharding, all-reduce across replicas now (False: keep the
        reduce-scattered sum and add it to the next reduction that does).
    hook: called with the reduced gradient shard (flat, in ``reduce_dtype``) once the
        reduction (and the replica all-reduce) is done; e.g. an all-reduce over another
        mesh dimension.
    force_sum: collectives always sum here and divide afterwards; with a hook, the
        hook then sees the sum (divided after it), as torch's does.
    unused_as_zeros: ``set_reduce_scatter_unused_params(True)``: a trainable parameter no
        rank used gets a zero gradient instead of None (Note [gradient presence flags]).
    """

    divide_factor: float | None = None
    all_reduce: bool = True
    hook: Callable[[torch.Tensor], None] | None = None
    force_sum: bool = False
    unused_as_zeros: bool = False


DEFAULT_REDUCE = ReduceOptions()


class PendingReduce:
    """A reduce-scatter in flight; ``finish`` averages it into the sharded ``.grad``s.

    Note [the replica all-reduce in flight]
    Under hybrid sharding a unit's shard sum is then all-reduced across replicas. Waited
    for as soon as it is issued, that all-reduce would hold the compute stream (NCCL) or
    the host (gloo) behind it once per unit. Instead, when the next unit's reduction is
    about to be issued, the oldest reduce-scatter in flight is waited for and its
    all-reduce only started (``start_replica_reduce``); it is finished one unit later, or
    when the gradients settle. At most one all-reduce is in flight beside the
    reduce-scatters (one, or as many as Note [reductions in flight] allows), all issued
    in the same order on every rank."""

    def __init__(self, unit_name: str, params: list[ShardedParam], had_grad: list[bool],
                 pending: Pending,
                 pool: BufferPool, buffers: list[torch.Tensor | None], views: list | None,
                 dest: torch.Tensor, replicate_pg: dist.ProcessGroup | None = None,
                 options: ReduceOptions = DEFAULT_REDUCE, partial: "PartialSum | None" = None,
                 copies: HostCopies | None = None, held: list[torch.Tensor] = (),
                 data_parallel_size: int = 1, measure_norms: bool = False,
                 grad_dtypes: list | None = None):
        self.unit_name = unit_name
        self.params = params
        self.handed_out = False  # the gradients became the parameters' .grad
        self.had_grad = had_grad
        self.pending = pending
        self._pool = pool
        self._buffers = buffers  # in use by the collective until it completes
        self._held = list(held)  # likewise, but not the pool's (a custom comm's buffers)
        self._views = views      # DTensor grads over ``dest``, or None: add to .grad
        self._dest = dest        # where the result lives, in the parameters' dtype
        self._replicate_pg = replicate_pg
        self._options = options
        self._partial = partial  # the group's sum kept by all_reduce=False
        self._copies = copies    # copies to offloaded (host) gradients, Note [streams and events]
        # the ranks this group's gradients are summed over (its shard group times its
        # replicas): the default divisor. A unit on a sub-mesh (experts on their own mesh)
        # divides by its own mesh's size, not its root's, as torch's FSDP2 does.
        self._data_parallel_size = data_parallel_size
        self._replicating = False  # the all-reduce across replicas is in flight
        # offloaded: measure the shard's norms on the device before the copy to the host
        # (Note [gradient norms measured before the copy to the host])
        self._measure_norms = measure_norms
        # each .grad's dtype where a grad_dtype sets one: ``dest`` is then in the reduced
        # dtype, and each shard is cast on its own (Note [a parameter's grad_dtype])
        self._grad_dtypes = grad_dtypes

    def finish(self, patience=None) -> "UnknownPresence | None":
        """Average the reduction into the sharded ``.grad``s; what is returned (when some
        parameter lacked a gradient here) says which may have had none anywhere."""
        with traced("finish_reduce", self.unit_name):
            return self._finish(patience)

    def start_replica_reduce(self, patience=None) -> bool:
        """Hybrid sharding: wait for the shard group's reduce-scatter and start the
        all-reduce across replicas without waiting for it; True when one was started
        (``finish`` then completes it). Note [the replica all-reduce in flight]."""
        if self._replicate_pg is None or not self._options.all_reduce or self._replicating:
            return False
        out = self.pending.wait(f"gradient reduction of {self.unit_name}", patience)
        self._partial.add_into(out)
        self.pending = all_reduce_sum(out, self._replicate_pg, async_op=True)
        self._replicating = True
        return True

    def _finish(self, patience) -> "UnknownPresence | None":
        options = self._options
        what = ("gradient all-reduce across replicas" if self._replicating
                else "gradient reduction")
        out = self.pending.wait(f"{what} of {self.unit_name}", patience)
        if self._replicate_pg is not None and not self._replicating:
            if not options.all_reduce:  # keep the shard-group sum; gradients come later
                self._partial.add(out)
                self._release_buffers()
                return None
            self._partial.add_into(out)
            all_reduce_sum(out, self._replicate_pg,
                           what=f"gradient all-reduce across replicas of {self.unit_name}")
        _before, divisor = divide_factors(out.dtype, options.divide_factor,
                                          self._data_parallel_size)
        grads = chunk_gradients(out, len(self.params))  # Note [a reduction's chunk]
        if options.hook is not None and options.force_sum:
            options.hook(grads)
        out.div_(divisor)
        if options.hook is not None and not options.force_sum:
            options.hook(grads)
        norms = self._measure(out)  # the final values, while still on the device
        if out is not self._dest:  # a cast into the fp32 gradients and/or a copy to the host
            if self._copies is not None and self._dest.device != out.device:
                self._copies.to_host(self._dest, out)  # readable after copies.settle()
                # the copy stream holds ``out`` until it is done: never back to the pool
                self._buffers = [b for b in self._buffers if b is not out]
                if any(p.sharded_param.grad is not None for p in self.params):
                    self._copies.settle()  # adding to existing gradients reads it now
            else:
                self._dest.copy_(out)
            out = self._dest
        self._release_buffers()  # ``out`` may have been one of them: only after the copy
        unknown = self._hand_out(out)
        self.handed_out = True
        if norms is not None:  # recorded after the last write into the gradients
            grad_norms.record([p.sharded_param.grad for p in self.params], norms)
        return unknown

    def _shards(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return split_chunk(out, [p.layout.shard_numel for p in self.params])

    def _measure(self, out: torch.Tensor) -> torch.Tensor | None:
        """Each parameter's norm of the reduced ``out`` (still on the device), where the
        result becomes the whole ``.grad`` as it is: offloaded, no hook, every parameter
        had a gradient, none is added to an existing ``.grad``; else None (Note [gradient
        norms measured before the copy to the host])."""
        if (not self._measure_norms or self._options.hook is not None
                or not all(self.had_grad)
                or any(p.sharded_param.grad is not None for p in self.params)):
            return None
        shards = self._shards(out)
        return grad_norms.measure([p.grad_rows(s) for p, s in zip(self.params, shards)])

    def _hand_out(self, out: torch.Tensor) -> "UnknownPresence | None":
        """Make (or add ``out`` into) the sharded ``.grad``s."""
        shards = self._shards(out)
        missing = []
        for i, (p, had) in enumerate(zip(self.params, self.had_grad)):
            if had:  # a gradient here: present, whatever an earlier reduction's flag says
                p.presence_unknown = False
            elif p.sharded_param.grad is None or p.presence_unknown:
                missing.append((p, i))
                p.presence_unknown = True
        unknown = UnknownPresence(missing, shards[-2]) if missing else None
        if self._views is not None:  # every .grad was None: hand out the views
            for p, view in zip(self.params, self._views):
                p.sharded_param.grad = view
            return unknown
        if self._grad_dtypes is not None:  # cast before any add, as torch's FSDP2 does
            shards = [s.to(d) for s, d in zip(shards[:len(self.params)], self._grad_dtypes)]
        for p, shard in zip(self.params, shards):
            current = p.sharded_param.grad
            if current is None:
                p.sharded_param.grad = p.sharded_grad(shard)
            else:
                current._local_tensor.add_(p.sharded_grad(shard)._local_tensor)
        return unknown

    def discard(self) -> None:
        """Wait for the collective (never free a buffer under it) and drop its result."""
        self.pending.wait(f"gradient reduction of {self.unit_name}")
        # the collective may have written into kept .grad views without a version bump
        grad_norms.forget([p.sharded_param.grad for p in self.params])
        self._release_buffers()

    def _release_buffers(self) -> None:
        for buf in self._buffers:
            if buf is not None:
                self._pool.give(buf)
        self._buffers, self._held = [], []


class UnknownPresence:
    """Parameters that had no gradient on this rank (and none before this reduction),
    given a gradient by a finished reduction before anyone read the presence flags:
    ``resolve`` sets back to None those no rank used (Note [gradient presence flags]).
    Resolved when the reduction is settled, after the backward's divergence check, so
    reading the flags never waits on the device inside backward."""

    def __init__(self, missing: list[tuple[ShardedParam, int]], flags: torch.Tensor):
        self.missing = missing  # (parameter, the index of its presence flag)
        self.flags = flags      # the reduced presence flags, one per reduced parameter


def resolve_all(unknown: list[UnknownPresence]) -> None:
    """Resolve every reduction's unknown presence with one read of the flags it needs:
    on a device, one host sync for the whole backward rather than one per unit."""
    wanted = [(presence, p, index) for presence in unknown for p, index in presence.missing
              if p.presence_unknown]
    if not wanted:
        return
    flags = torch.stack([presence.flags[index] for presence, _, index in wanted]).tolist()
    # several reductions may have added into one parameter (backwards left unsettled by
    # set_is_last_backward(False)): it keeps its gradient if any rank had one in any
    used = {id(p) for (_, p, _), flag in zip(wanted, flags) if flag > 0}
    for _, p, _ in wanted:
        if id(p) not in used:
            p.sharded_param.grad = None
        p.presence_unknown = False


class PartialSum:
    """A group's reduce-scattered gradient sum held back from the replica all-reduce by
    ``set_requires_all_reduce(False)`` (HSDP gradient accumulation): the next reduction
    that all-reduces adds it in first."""

    def __init__(self):
        self.total: torch.Tensor | None = None

    def add(self, out: torch.Tensor) -> None:
        if self.total is None:
            self.total = out.clone()
        else:
            self.total.add_(out)

    def add_into(self, out: torch.Tensor) -> None:
        if self.total is not None:
            out.add_(self.total)
            self.total = None


class _Packed(NamedTuple):
    """A reduction's send buffer and what it was built with (GradReduction._pack)."""

    full: torch.Tensor           # world x numel, rank-major, in the reduce dtype
    had_grad: list[bool]         # per trainable parameter: a local gradient existed
    numel: int                   # one rank's chunk, flags and digest included
    plan: object                 # core/schedule.reduce_plan's answer
    comm: object                 # the unit's custom reduce-scatter, or None
    inspected: bool              # the chunk's digest is compared in the collective
    pooled: bool                 # ``full`` is the pool's (else its allocator's: held)
    grad_dtypes: list | None     # each sharded .grad's dtype, where a grad_dtype sets one


class ReducedGroup(Protocol):
    """What a reduction reads of the group it serves (a ParamGroup, core/group.py)."""

    params: list[ShardedParam]
    unit_name: str
    reduce_dtype: torch.dtype | None
    pool: BufferPool
    guard: Guard | None
    offload: object  # the CPUOffloadPolicy, or None
    comm_options: object  # core/comm_groups.CommOptions
    storage: object  # its shard (core/storage.py): the sharded gradients' dtype and device

    @property
    def reduce_scatter_pg(self) -> dist.ProcessGroup: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...

    @property
    def compute_device(self) -> torch.device: ...

    def trainable(self) -> list[ShardedParam]: ...


def _kept(cached: torch.Tensor | None, shape: tuple, like: torch.Tensor,
          value: float) -> torch.Tensor:
    """``cached`` if it still fits ``shape`` and ``like``'s dtype and device, else a new
    tensor of ``value``."""
    if (cached is None or tuple(cached.shape) != shape or cached.dtype != like.dtype
            or cached.device != like.device):
        return torch.full(shape, value, dtype=like.dtype, device=like.device)
    return cached


class GradReduction:
    """One group's gradient side: lays this backward's unsharded gradients out, starts
    their reduce-scatter (or all-reduce), and keeps the sharded gradient buffers that
    the reduction writes (Note [persistent sharded gradients]). ``group`` is the
    ParamGroup it serves: its process groups, dtypes, buffers and guard."""

    def __init__(self, group: ReducedGroup):
        self.group = group
        self.partial_sum = PartialSum()  # set_requires_all_reduce(False) under HSDP
        self._all_present: torch.Tensor | None = None
        self._no_digest: torch.Tensor | None = None
        self._digest_rows: torch.Tensor | None = None
        self._grad_key: tuple | None = None
        self._grad_buffer: torch.Tensor | None = None
        self._grad_views: list = []
        # the other of two kept buffers under the delayed update: (buffer, key, views)
        self._spare: tuple = (None, None, [])

    @property
    def data_parallel_size(self) -> int:
        """The ranks this group's gradients are summed over: its shard group times its
        replicas (the default divisor; a unit on a sub-mesh counts its own mesh)."""
        g = self.group
        return g.world_size * (g.replicate_pg.size() if g.replicate_pg is not None else 1)

    def forget(self) -> None:
        """Drop the gradients not yet reduced (``reset_iter_state``)."""
        self.partial_sum.total = None
        for p in self.group.params:
            p.accumulated_grad = None
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None

    def hand_off_kept(self) -> None:
        """The kept gradients go to a delayed host step, which reads them while the next
        backward runs (Note [the delayed update]): that backward writes the other of two
        kept buffers, free again since the step before finished (it is waited for before
        another is handed out)."""
        kept = (self._grad_buffer, self._grad_key, self._grad_views)
        (self._grad_buffer, self._grad_key, self._grad_views), self._spare = self._spare, kept

    # Note [the reduction's tail, one row per rank]
    # Every rank's chunk of the send buffer ends in the presence flags and the digest, so
    # they enter ``_chunk_cat`` as (world, n) tensors. Materialized rather than stride-0
    # views of one row (``_chunk_cat``'s fast path wants contiguous inputs), and kept from
    # step to step: made each step they would be an allocation that grows with the world
    # size. The compute stream consumes them before the next step writes them again.
    def _presence_flags(self, had_grad: list[bool], like: torch.Tensor,
                        world: int) -> torch.Tensor:
        """One flag per trainable param, one row per rank; the all-present rows are kept
        (no host copy)."""
        shape = (world, len(had_grad))
        if all(had_grad):
            self._all_present = _kept(self._all_present, shape, like, 1)
            return self._all_present
        flags = torch.ones(shape, dtype=like.dtype, device=like.device)
        for i, present in enumerate(had_grad):
            if not present:
                flags[:, i].fill_(0)  # a fill kernel: no host-to-device copy
        return flags

    def _digest(self, inspected: bool, like: torch.Tensor, world: int) -> torch.Tensor:
        """The ledger's digest as DIGEST_NUMEL elements of 8 bits each (exact in any float
        dtype), or zeros where nobody inspects it, one row per rank, kept."""
        shape = (world, DIGEST_NUMEL)
        if not inspected:
            self._no_digest = _kept(self._no_digest, shape, like, 0)
            return self._no_digest
        rows = self._digest_rows = _kept(self._digest_rows, shape, like, 0)
        digest = torch.tensor(digest_elements(self.group.guard.ledger.digest),
                              dtype=like.dtype)
        return rows.copy_(digest.to(like.device).expand(shape))


    def reduce(self, options: ReduceOptions = DEFAULT_REDUCE) -> "PendingReduce | None":
        """Start reducing the unsharded gradients (sum, asynchronously) and free them
        (Note [gradient presence flags])."""
        with traced("reduce_scatter", self.group.unit_name):
            return self._reduce(options)


    def _reduce(self, options: ReduceOptions) -> "PendingReduce | None":
        """See ``reduce``.

        Note [gradient presence flags]
        A parameter unused on one rank has no gradient there but may have one on
        another. It is reduced as zeros, so every rank sends the same layout, and each
        rank appends one flag per parameter (1 = I have a gradient) to every chunk: after
        the reduce every rank knows which parameters got a gradient anywhere. Those get
        the mean gradient (zeros counted for ranks that lacked it); the rest are set back
        to ``grad=None`` when the reduction is settled (``UnknownPresence``), as in
        single-process training and as torch's FSDP2 leaves a parameter no rank used.
        Ranks that had every gradient locally never read the flags, and the others read
        them only when the backward's gradients are settled, after the divergence check
        (no device sync inside backward). With ``set_reduce_scatter_unused_params(True)``
        every trainable parameter of a reduced unit gets a gradient, zeros where no rank
        used it, as torch's FSDP2 does with that setting. Several reductions may add into
        one parameter before the flags are read (backwards left unsettled by
        ``set_is_last_backward(False)``): it keeps its gradient if any rank had one in
        any of them (``ShardedParam.presence_unknown`` marks those still in question).
        """
        g = self.group
        trainable = g.trainable()
        if not trainable:
            return None
        w = g.world_size
        ref = trainable[0].unsharded_local
        full, had_grad, numel, plan, comm, inspected, pooled, grad_dtypes = self._pack(
            trainable, options)
        reduce_dtype = full.dtype
        # a staged ``full`` is held, not pooled (Note [staging buffers from the process group])
        own, held = ([full], []) if pooled else ([], [full])
        pg = g.reduce_scatter_pg  # Note [a reduce-scatter group of its own]
        if grad_dtypes is None:
            dest, views = self._grad_destination(trainable, numel, g.storage.dtype,
                                                 g.storage.device)
        else:  # each shard is cast from the reduced dtype (Note [a parameter's grad_dtype])
            dest, views = self._new_grad_buffer(numel, reduce_dtype, g.storage.device), None
        # what every reduction below hands its PendingReduce; the buffers it holds and
        # whether it all-reduces across replicas after the collective differ
        pending_reduce = functools.partial(
            PendingReduce, g.unit_name, trainable, had_grad, pool=g.pool, views=views,
            dest=dest, options=options, copies=g.copies,
            measure_norms=g.offload is not None and grad_dtypes is None,
            data_parallel_size=self.data_parallel_size, grad_dtypes=grad_dtypes)
        across = {"replicate_pg": g.replicate_pg, "partial": self.partial_sum}
        if plan.all_reduce:  # Note [shard groups of one rank]
            if not options.all_reduce:  # hold the local sum back: PendingReduce keeps it
                return pending_reduce(pending=Pending(full, None), buffers=own, held=held,
                                      **across)
            self.partial_sum.add_into(full.view(-1))
            return pending_reduce(pending=all_reduce_sum(full, g.replicate_pg, async_op=True),
                                  buffers=own, held=held)
        if comm is not None:  # Note [custom collectives]
            out = comm.allocate((numel,), dtype=reduce_dtype, device=ref.device)
            work = comm(output_tensor=out, input_tensor=full, group=pg, op=dist.ReduceOp.SUM)
            # ``full`` is the comm's (never pooled), but it must live until the collective
            # has finished: an async comm reads it after this returns
            return pending_reduce(pending=Pending(out, work), buffers=[], held=[full], **across)
        if g.quantize_grads and not skips_collectives(w):  # Note [quantized communication]
            out = torch.empty(numel, dtype=reduce_dtype, device=ref.device) if plan.output \
                else dest
            pending = quantized_reduce_scatter_sum(out, full, pg, g.quantize_grads,
                                                   exact_tail=chunk_tail_numel(len(trainable)),
                                                   async_op=True)
            return pending_reduce(pending=pending, buffers=own, held=held, **across)
        scratch = g.pool.take(w * numel, reduce_dtype, ref.device) if plan.scratch else None
        out = torch.empty(numel, dtype=reduce_dtype, device=ref.device) if plan.output else dest
        inspect = (g.guard.inspector(functools.partial(received_digests, chunk=numel))
                   if inspected else None)
        pending = reduce_scatter_sum(out, full, pg, async_op=True, scratch=scratch,
                                     inspect=inspect)
        return pending_reduce(pending=pending, buffers=own + [scratch], held=held, **across)

    def _pack(self, trainable: list[ShardedParam], options: ReduceOptions) -> "_Packed":
        """The unsharded gradients laid out rank-major in one send buffer in the reduce
        dtype, each rank's chunk ending in the presence flags and the ledger digest; the
        gradients themselves are dropped. Also what the reduction needs to know about it."""
        g = self.group
        w = g.world_size
        ref = trainable[0].unsharded_local
        grads = [take_unsharded_grad(p) for p in trainable]
        had_grad = [True] * len(grads) if options.unused_as_zeros else [
            g is not None for g in grads]
        grads = [g if g is not None else torch.zeros_like(p.unsharded_local)
                 for p, g in zip(trainable, grads)]
        reduce_dtype = g.reduce_dtype or ref.dtype
        if len({g.dtype for g in grads}) > 1:  # some were accumulated in reduce_dtype
            grads = [g.to(reduce_dtype) for g in grads]
        grad_dtypes = (sharded_grad_dtypes(g, trainable, reduce_dtype, options.unused_as_zeros)
                       if any(p.grad_policy.explicit for p in trainable) else None)
        grads = [p.layout.rank_major(w, g) for p, g in zip(trainable, grads)]
        # one row per rank, kept (Note [the reduction's tail, one row per rank])
        flags = self._presence_flags(had_grad, grads[0], w)
        numel = chunk_numel([p.layout.shard_numel for p in trainable])
        comm = None if skips_collectives(w) else g.reduce_scatter_comm
        plan = reduce_plan(shard_size=w, replicated=g.replicate_pg is not None,
                           backend=dist.get_backend(g.pg), reduce_dtype=reduce_dtype,
                           compute_device=ref.device,
                           grad_dtype=g.storage.dtype if grad_dtypes is None else reduce_dtype,
                           grad_device=g.storage.device)
        if plan.all_reduce and options.all_reduce:
            g._record("all-reduce", w * numel)
        elif not skips_collectives(w):  # Note [a reduce-scatter group of its own]
            g._record("reduce-scatter" if g.comm_options.reduce_pg is None
                      else REDUCE_SCATTER_OWN_GROUP, w * numel)
        # Note [ranks agree on every collective]: on gloo the ranks compare the digests
        # (which include this reduction) before summing; elsewhere the digest is zeros
        inspected = (not plan.all_reduce and comm is None and not g.quantize_grads
                     and g.patience is not None and not skips_collectives(w)
                     and g.replicate_pg is None and w == len(g.guard.ranks))
        digest = self._digest(inspected, grads[0], w)
        # see Note [staging buffers from the process group]
        staging = g.comm_options.reduce_staging
        if comm is not None:
            full, pooled = comm.allocate((w * numel,), dtype=reduce_dtype,
                                         device=ref.device), False
        elif staging is not None:
            full, pooled = staging.take(g.pool, g.reduce_scatter_pg, w * numel, reduce_dtype,
                                        ref.device)
        else:
            full, pooled = g.pool.take(w * numel, reduce_dtype, ref.device), True
        # _chunk_cat casts into ``full``: gradients leave in reduce_dtype
        torch._chunk_cat(grads + [flags, digest], dim=0, num_chunks=w, out=full.view(w, numel))
        before, _after = divide_factors(reduce_dtype, options.divide_factor,
                                        self.data_parallel_size)
        if before != 1:  # Note [dividing fp16 gradients before and after the sum]
            full.view(w, numel)[:, :numel - chunk_tail_numel(len(trainable))].div_(before)
        del grads  # the unsharded gradients die here, before the receive buffers exist
        for p in trainable:
            p.unsharded_param.grad = None
        return _Packed(full, had_grad, numel, plan, comm, inspected, pooled, grad_dtypes)

    def accumulate_unsharded(self) -> None:
        """Without gradient sync: move this backward's unsharded gradients into a
        per-parameter accumulator in ``reduce_dtype`` (bf16 sums lose precision fast), so
        AccumulateGrad starts fresh next time; the synced backward reduces the sum. A unit
        with an explicit ``grad_dtype`` accumulates each parameter in its own accumulation
        dtype (Note [a parameter's grad_dtype])."""
        g = self.group
        trainable = g.trainable()
        followed = any(p.grad_policy.explicit for p in trainable)
        dtypes = accumulation_dtypes(g, trainable) if followed else None
        if not followed:
            if g.reduce_dtype is None or g.reduce_dtype == g.compute_dtype:
                return  # accumulating in .grad itself is exact enough
            dtypes = [g.reduce_dtype] * len(trainable)
        for p, dtype in zip(trainable, dtypes):
            grad = p.local_grad(p.unsharded_param.grad)
            if grad is None:
                continue
            if followed and p.accumulated_grad is None and dtype in (None, grad.dtype):
                continue  # AccumulateGrad adds the next one in .grad, in its dtype
            p.unsharded_param.grad = None
            if p.accumulated_grad is None:
                p.accumulated_grad = grad.to(dtype)
            else:
                p.accumulated_grad += grad


    def _new_grad_buffer(self, numel: int, dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
        """Sharded gradients beside the flat shard (its ``dtype``, on its ``device``);
        pinned when offloaded from CUDA, so the copy from the device does not block (Note
        [streams and events]), unless the policy says ``pin_memory=False``."""
        offload = self.group.offload
        pin = (device.type == "cpu" and self.group.compute_device.type == "cuda"
               and offload is not None and offload.pin_memory)
        return torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)


    def _grad_destination(self, trainable: list[ShardedParam], numel: int,
                          dtype: torch.dtype, device: torch.device
                          ) -> tuple[torch.Tensor, list | None]:
        """Where the reduce-scatter writes, and the DTensor grads viewing it (None when
        the result must be added to gradients that already exist).

        Note [persistent sharded gradients]
        After ``zero_grad()`` every step would allocate the sharded gradients and build
        one DTensor per parameter (~3 ms per step for W2's 388 parameters). Groups up to
        the pool's size limit (Note [which buffers are pooled]) instead keep one flat
        gradient buffer and DTensor views of it, and hand the same objects out as
        ``.grad`` again: the reduce-scatter writes straight into them. Larger groups get
        fresh gradients every step: a kept buffer would stay allocated from
        ``zero_grad`` through the next forward, on top of the activations (W3's peak
        rose from 2.72 to 2.83 GiB when every group kept one). For small groups, a
        ``.grad`` object kept across ``zero_grad(set_to_none=True)`` sees the next
        step's values, as with DDP's ``gradient_as_bucket_view=True``.
        """
        if not self.group.pool.keeps(numel) or any(p.sharded_param.grad is not None
                                             for p in trainable):
            return self._new_grad_buffer(numel, dtype, device), None
        key = (tuple(map(id, trainable)), dtype, device)
        if key != self._grad_key:
            buf = self._new_grad_buffer(numel, dtype, device)
            shards = split_chunk(buf, [p.layout.shard_numel for p in trainable])
            self._grad_views = [p.sharded_grad(shard) for p, shard in zip(trainable, shards)]
            self._grad_buffer, self._grad_key = buf, key
        return self._grad_buffer, self._grad_views
