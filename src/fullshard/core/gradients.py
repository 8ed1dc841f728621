"""The gradient side of a group: taking unsharded gradients, finishing a reduce.

``ParamGroup.reduce_grads`` lays the gradients out and starts the reduce-scatter;
``PendingReduce`` completes it: replica all-reduce under hybrid sharding, the mean,
the cast back into the parameters' dtype, and handing the shards out as ``.grad``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .buffers import BufferPool
from .collectives import Pending, all_reduce_sum
from .param import ShardedParam


def take_unsharded_grad(p: ShardedParam) -> torch.Tensor | None:
    """This backward's unsharded gradient plus any accumulated without sync, or None."""
    grad, acc = p.unsharded_param.grad, p.accumulated_grad
    p.accumulated_grad = None
    if acc is None:
        return grad
    return acc if grad is None else acc.add_(grad)


class PendingReduce:
    """A reduce-scatter in flight; ``finish`` averages it into the sharded ``.grad``s."""

    def __init__(self, unit_name: str, params: list[ShardedParam], had_grad: list[bool],
                 pending: Pending,
                 pool: BufferPool, buffers: list[torch.Tensor | None], views: list | None,
                 dest: torch.Tensor, replicate_pg: dist.ProcessGroup | None = None):
        self.unit_name = unit_name
        self.params = params
        self.had_grad = had_grad
        self.pending = pending
        self._pool = pool
        self._buffers = buffers  # in use by the collective until it completes
        self._views = views      # DTensor grads over ``dest``, or None: add to .grad
        self._dest = dest        # where the result lives, in the parameters' dtype
        self._replicate_pg = replicate_pg

    def finish(self, world_size: int) -> None:
        out = self.pending.wait(f"gradient reduction of {self.unit_name}")
        if self._replicate_pg is not None:  # hybrid sharding: sum the replicas' shards
            all_reduce_sum(out, self._replicate_pg,
                           what=f"gradient all-reduce across replicas of {self.unit_name}")
        out.div_(world_size)
        if out is not self._dest:  # a cast into the fp32 gradients and/or a copy to the CPU
            self._dest.copy_(out)
            out = self._dest
        for buf in self._buffers:  # ``out`` may be one of them: give back after the copy
            if buf is not None:
                self._pool.give(buf)
        self._buffers = []
        sizes = [p.layout.shard_numel for p in self.params]
        shards = torch.split(out, sizes + [len(self.params)])
        if all(self.had_grad):
            present = self.had_grad
        else:  # see Note [gradient presence flags]
            present = [f > 0 for f in shards[-1].tolist()]
        if self._views is not None:  # every .grad was None: hand out the views
            for p, view, keep in zip(self.params, self._views, present):
                if keep:
                    p.sharded_param.grad = view
            return
        for p, shard, keep in zip(self.params, shards, present):
            if not keep:
                continue
            current = p.sharded_param.grad
            if current is None:
                p.sharded_param.grad = p.sharded_grad(shard)
            else:
                current._local_tensor.add_(p.sharded_grad(shard)._local_tensor)
