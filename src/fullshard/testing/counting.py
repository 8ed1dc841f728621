"""Count the collectives fullshard issues (tests patch them in, never the hot path)."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable

import torch
import torch.distributed as dist

from ..core import comm as comm_module


@contextlib.contextmanager
def count_collectives():
    """Yield a Counter with keys ``all_gather``/``all_gather_async``/``reduce_scatter``/
    ``all_reduce`` (gathers within a post-forward subgroup, ``reshard_after_forward=N``,
    those of tensor-subclass parameters and quantized ones count too; collectives over a
    group of one rank are not issued and not counted, unless ``collectives_at_one_rank``
    is on). Counted where fullshard issues them (Note [one seam for observing
    collectives]), so no import site escapes."""
    counts: Counter = Counter()

    def count(kind: str, _group, async_op: bool) -> None:
        counts[kind + ("_async" if async_op and kind == "all_gather" else "")] += 1

    with comm_module.observing(count):
        yield counts


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
