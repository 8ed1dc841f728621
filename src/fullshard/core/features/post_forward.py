"""PostForwardShard: ``reshard_after_forward=N``, ZeRO++ hpZ-style.

Note [resharding after forward to a smaller group]
With an integer N the unit does not free its gathered parameters after forward,
nor keep them whole: each rank keeps 1/N of the gathered (param-major) buffer,
its chunk within a group of N consecutive ranks, so backward gathers from N ranks
(within a node, say) instead of the whole shard group. Because the chunks are
contiguous pieces of the unsharded buffer, that gather writes straight into it
(no copy-out). Memory: 1/N of the unit instead of 0 (ZeRO-3) or 1 (ZeRO-2).
The subgroups are created once per (group, N), by their members.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ..comm import Pending, all_gather

# default group -> {(ranks of the shard group, size) -> this rank's subgroup}: units with
# the same hpZ size over the same ranks share one. Keyed by the default group because a
# group belongs to the world that made it: a process re-initialized after
# destroy_process_group has a new world, and under torch's threaded process group each
# rank is a thread with a world of its own, so a subgroup cached by another rank (or an
# earlier world) is not registered in this one and its collectives fail.
_SUBGROUPS: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict]" = weakref.WeakKeyDictionary()


def subgroup_of(pg: dist.ProcessGroup, size: int) -> dist.ProcessGroup:
    """This rank's group of ``size`` consecutive ranks of ``pg``, made by its members only
    (local synchronization). Under hybrid sharding each replica's shard group makes its
    own subgroups: made the ordinary way (every rank of the job, named by a counter), the
    replicas' disjoint subgroups would get the same name, and so the same keys in the
    store through which their members meet (NCCL's unique ids among them); hashed from
    their ranks, each name is its own, and no rank waits on subgroups it is not in."""
    ranks = tuple(dist.get_process_group_ranks(pg))
    key = (ranks, size)
    made = _SUBGROUPS.setdefault(dist.group.WORLD, {})
    if key not in made:
        me = ranks.index(dist.get_rank())
        start = me - me % size
        made[key] = dist.new_group(ranks=list(ranks[start:start + size]),
                                   use_local_synchronization=True)
    return made[key]


class PostForwardShard:
    """This rank's chunk of a unit's gathered parameters between forward and backward."""

    def __init__(self, pg: dist.ProcessGroup, size: int):
        self.group = subgroup_of(pg, size)
        self.size = size
        self.rank = self.group.rank()
        self.chunk: torch.Tensor | None = None

    def keep(self, unsharded: torch.Tensor) -> None:
        """Copy this rank's 1/size of ``unsharded`` (flat, gathered) before it is freed."""
        n = unsharded.numel() // self.size
        self.chunk = unsharded[self.rank * n:(self.rank + 1) * n].clone()

    def gather_into(self, unsharded: torch.Tensor, async_op: bool, patience=None) -> Pending:
        """All-gather the chunks within the subgroup straight into ``unsharded``."""
        chunk, self.chunk = self.chunk, None
        return all_gather(unsharded, chunk, self.group, async_op=async_op,
                          what="all-gather within a post-forward subgroup", patience=patience)

    def drop(self) -> None:
        self.chunk = None
