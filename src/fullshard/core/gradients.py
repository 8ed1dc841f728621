"""The gradient side of a group: taking unsharded gradients, finishing a reduce.

``ParamGroup.reduce_grads`` lays the gradients out and starts the reduce-scatter;
``PendingReduce`` completes it: replica all-reduce under hybrid sharding, the mean,
the cast back into the parameters' dtype, and handing the shards out as ``.grad``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .buffers import BufferPool
from .collectives import Pending, all_reduce_sum
from .param import ShardedParam
from .schedule import DIGEST_NUMEL, reduce_tail
from .streams import HostCopies, traced


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
    """A reduce-scatter in flight; ``finish`` averages it into the sharded ``.grad``s."""

    def __init__(self, unit_name: str, params: list[ShardedParam], had_grad: list[bool],
                 pending: Pending,
                 pool: BufferPool, buffers: list[torch.Tensor | None], views: list | None,
                 dest: torch.Tensor, replicate_pg: dist.ProcessGroup | None = None,
                 options: ReduceOptions = DEFAULT_REDUCE, partial: "PartialSum | None" = None,
                 copies: HostCopies | None = None, held: list[torch.Tensor] = ()):
        self.unit_name = unit_name
        self.params = params
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

    def finish(self, world_size: int, patience=None) -> "UnknownPresence | None":
        """Average the reduction into the sharded ``.grad``s; what is returned (when some
        parameter lacked a gradient here) says which may have had none anywhere."""
        with traced("finish_reduce", self.unit_name):
            return self._finish(world_size, patience)

    def _finish(self, world_size: int, patience) -> "UnknownPresence | None":
        out = self.pending.wait(f"gradient reduction of {self.unit_name}", patience)
        options = self._options
        if self._replicate_pg is not None:  # hybrid sharding: sum the replicas' shards
            if not options.all_reduce:  # keep the shard-group sum; gradients come later
                self._partial.add(out)
                self._release_buffers()
                return None
            self._partial.add_into(out)
            all_reduce_sum(out, self._replicate_pg,
                           what=f"gradient all-reduce across replicas of {self.unit_name}")
        divisor = options.divide_factor or world_size
        grads = out[:out.numel() - reduce_tail(len(self.params))]  # without flags and digest
        if options.hook is not None and options.force_sum:
            options.hook(grads)
        out.div_(divisor)
        if options.hook is not None and not options.force_sum:
            options.hook(grads)
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
        sizes = [p.layout.shard_numel for p in self.params]
        shards = torch.split(out, sizes + [len(self.params), DIGEST_NUMEL])
        unknown = None if all(self.had_grad) else UnknownPresence(
            [(p, i) for i, (p, had) in enumerate(zip(self.params, self.had_grad))
             if not had and p.sharded_param.grad is None], shards[-2])
        if self._views is not None:  # every .grad was None: hand out the views
            for p, view in zip(self.params, self._views):
                p.sharded_param.grad = view
            return unknown
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

    def resolve(self) -> None:
        if not self.missing:
            return
        flags = self.flags.tolist()
        for p, index in self.missing:
            if flags[index] <= 0:
                p.sharded_param.grad = None


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
