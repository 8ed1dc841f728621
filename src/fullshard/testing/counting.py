"""Count the collectives fullshard issues (tests patch them in, never the hot path)."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable

import torch
import torch.distributed as dist

from ..core import comm as comm_module
from ..core.comm import skips_collectives
from ..core import gradients as gradients_module
from ..core import group as group_module
from ..core import post_forward as post_forward_module
from ..core import subclass_params as subclass_module


@contextlib.contextmanager
def count_collectives():
    """Yield a Counter with keys ``all_gather``/``all_gather_async``/``reduce_scatter``/
    ``all_reduce`` (gathers within a post-forward subgroup, ``reshard_after_forward=N``,
    and those of tensor-subclass parameters count too; collectives over a group of one
    rank are not issued and not counted, unless ``collectives_at_one_rank`` is on)."""
    counts: Counter = Counter()
    real_ag, real_rs = group_module.all_gather, gradients_module.reduce_scatter_sum
    real_ar = gradients_module.all_reduce_sum

    def all_gather(out, shard, pg, async_op=False, **kwargs):
        if not skips_collectives(pg.size()):
            counts["all_gather_async" if async_op else "all_gather"] += 1
        return real_ag(out, shard, pg, async_op=async_op, **kwargs)

    def reduce_scatter_sum(out, full, pg, async_op=False, **kwargs):
        if not skips_collectives(pg.size()):
            counts["reduce_scatter"] += 1
        return real_rs(out, full, pg, async_op=async_op, **kwargs)

    def all_reduce_sum(tensor, pg, async_op=False, **kwargs):
        if not skips_collectives(pg.size()):
            counts["all_reduce"] += 1
        return real_ar(tensor, pg, async_op=async_op, **kwargs)

    patches = [(group_module, "all_gather", all_gather),
               (gradients_module, "reduce_scatter_sum", reduce_scatter_sum),
               (post_forward_module, "all_gather", all_gather),
               (subclass_module, "all_gather", all_gather),
               (gradients_module, "all_reduce_sum", all_reduce_sum)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    for mod, name, fn in patches:
        setattr(mod, name, fn)
    try:
        yield counts
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def count_sent_bytes():
    """Yield a Counter of the bytes this rank sends: ``all_gather`` (fullshard's flat
    all-gathers, quantized or not) and ``reduce_scatter`` (all-to-alls: gloo's
    reduce-scatter is one, Note [reduce-scatter on gloo], and so is the quantized one)."""
    counts: Counter = Counter()
    real_gather, real_a2a = comm_module._all_gather_flat, dist.all_to_all_single

    def gather(output, input, *args, **kwargs):
        counts["all_gather"] += input.numel() * input.element_size()
        return real_gather(output, input, *args, **kwargs)

    def a2a(output, input, *args, **kwargs):
        counts["reduce_scatter"] += input.numel() * input.element_size()
        return real_a2a(output, input, *args, **kwargs)

    comm_module._all_gather_flat, dist.all_to_all_single = gather, a2a
    try:
        yield counts
    finally:
        comm_module._all_gather_flat, dist.all_to_all_single = real_gather, real_a2a


def count_forward_backward(forward: Callable[[], torch.Tensor]) -> tuple[dict, dict]:
    """Run ``forward()`` (returning a loss) and its backward; the collectives of each."""
    with count_collectives() as fwd:
        loss = forward()
    with count_collectives() as bwd:
        loss.backward()
    return dict(fwd), dict(bwd)
