"""count_collectives counts where fullshard issues its collectives (Note [one seam for
observing collectives]): a collective reached through any import of it is counted, and so
are quantized ones, which a count patched into import sites missed."""

import torch
import torch.distributed as dist

from fullshard.testing import run_distributed
from fullshard.testing.counting import count_collectives


def _count_through_fresh_imports():
    from fullshard.core.comm import all_gather as gather_here  # an import site of its own
    from fullshard.core.comm import all_reduce_sum, reduce_scatter_sum
    from fullshard.core.features.quantized_collectives import (quantized_all_gather,
                                                      quantized_reduce_scatter_sum)
    group, world = dist.group.WORLD, dist.get_world_size()
    shard = torch.ones(256)
    with count_collectives() as counts:
        gather_here(torch.empty(world * 256), shard, group)
        gather_here(torch.empty(world * 256), shard, group, async_op=True).wait()
        reduce_scatter_sum(torch.empty(256), torch.ones(world * 256), group)
        all_reduce_sum(torch.ones(4), group)
        quantized_all_gather(torch.empty(world * 256), shard, group, 64)
        quantized_reduce_scatter_sum(torch.empty(256), torch.ones(world * 256), group, 64)
    after = dict(counts)
    gather_here(torch.empty(world * 256), shard, group)  # outside the block: not counted
    return after, dict(counts)


def test_every_collective_is_counted_whatever_imported_it():
    for inside, later in run_distributed(_count_through_fresh_imports, 2):
        assert inside == {"all_gather": 2, "all_gather_async": 1, "reduce_scatter": 2,
                          "all_reduce": 1}, inside
        assert later == inside
