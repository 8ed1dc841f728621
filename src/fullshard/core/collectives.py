"""Stateless collectives over a process group.

Each function takes tensors and a process group and returns a small NamedTuple;
none of them reads module state. ``async_op=True`` returns the work handle so
the caller can overlap the collective with compute and ``wait()`` later.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

# torch >= 2.10 names the flat collectives *_single; older releases only have
# the *_into_tensor / *_tensor spellings (same semantics).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Note [collectives are always issued async]
# Blocking calls are issued with async_op=True and waited at once: on gloo, a process
# that made blocking collectives on a group it still references can abort at exit
# ("terminate called without an active exception") after destroy_process_group.
# The async form has the same cost and no such exit path.


class Pending(NamedTuple):
    """A collective in flight (or finished, when ``work`` is None)."""

    output: torch.Tensor
    work: dist.Work | None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.output


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
               async_op: bool = False) -> Pending:
    """Gather every rank's equal-sized ``shard`` into ``output`` (rank-major)."""
    if group.size() == 1:
        output.copy_(shard)
        return Pending(output, None)
    pending = Pending(output, _all_gather_flat(output, shard, group=group, async_op=True))
    return pending if async_op else Pending(pending.wait(), None)


def reduce_scatter_sum(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                       async_op: bool = False) -> Pending:
    """Sum ``full`` (rank-major chunks) over ranks; this rank's chunk lands in ``output``."""
    if group.size() == 1:
        output.copy_(full)
        return Pending(output, None)
    work = _reduce_scatter_flat(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    pending = Pending(output, work)
    return pending if async_op else Pending(pending.wait(), None)
