"""Count the collectives fullshard issues (tests patch them in, never the hot path)."""

from __future__ import annotations

import contextlib
from collections import Counter

from ..core import group as group_module
from ..core import post_forward as post_forward_module


@contextlib.contextmanager
def count_collectives():
    """Yield a Counter with keys ``all_gather``/``all_gather_async``/``reduce_scatter``
    (gathers within a post-forward subgroup, ``reshard_after_forward=N``, count too)."""
    counts: Counter = Counter()
    real_ag, real_rs = group_module.all_gather, group_module.reduce_scatter_sum

    def all_gather(out, shard, pg, async_op=False):
        counts["all_gather_async" if async_op else "all_gather"] += 1
        return real_ag(out, shard, pg, async_op=async_op)

    def reduce_scatter_sum(out, full, pg, async_op=False, scratch=None):
        counts["reduce_scatter"] += 1
        return real_rs(out, full, pg, async_op=async_op, scratch=scratch)

    group_module.all_gather, group_module.reduce_scatter_sum = all_gather, reduce_scatter_sum
    post_forward_module.all_gather = all_gather
    try:
        yield counts
    finally:
        group_module.all_gather, group_module.reduce_scatter_sum = real_ag, real_rs
        post_forward_module.all_gather = real_ag
