"""The statistics that close a training step, at the same cost at any world size.

A step's record needs from the ranks: the loss's mean over them, whether any of them was
asked to stop, each memory figure at its largest over them, and the gradient norm (global
already: the same on every rank). Two all-reduces of a fixed size give them, a SUM for
the loss and a MAX for the stop request and the figures, issued back to back over one
device buffer that then goes to the host in one copy: the step's one host
synchronization. float64 holds byte counts exactly up to 8 PiB.

Every rank's own peak (a list as long as the world) is gathered only on the steps whose
host waits anyway, for an evaluation or a checkpoint (``peaks``); in the same copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name).
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

# The buffer a rank sends: [loss, grad_norm, stop request, *FIGURES] (the peak first).
LOSS, NORM, STOP = 0, 1, 2
PEAK = STOP + 1


@dataclass(frozen=True)
class StepStats:
    """What every rank knows of the step once the statistics are in, the same everywhere.
    ``figures``: the memory ``FIGURES``, each the largest over ranks (float64, on the
    host); ``peaks``: each rank's peak, on the steps that gather them, else None."""

    loss: float
    grad_norm: float
    stopping: bool
    figures: torch.Tensor
    peaks: list[int] | None


def reduce_stats(mine: torch.Tensor, world: int, peaks: bool) -> StepStats:
    """The step's statistics from this rank's ``mine`` (float64, on the device, laid out
    as ``LOSS, NORM, STOP, *FIGURES``; reduced in place) and, where ``peaks``, every
    rank's peak."""
    # the all-reduce below overwrites this rank's peak with the largest
    own_peak = mine[PEAK:PEAK + 1].clone() if peaks else None
    works = [dist.all_reduce(mine[LOSS:NORM], op=dist.ReduceOp.SUM, async_op=True),
             # the norm (between them) is left alone: it is global, and a MAX over NaNs
             # may drop them
             dist.all_reduce(mine[STOP:], op=dist.ReduceOp.MAX, async_op=True)]
    everyone = None
    if own_peak is not None:
        everyone = torch.empty(world, dtype=mine.dtype, device=mine.device)
        works.append(_all_gather_single(everyone, own_peak, async_op=True))
    for work in works:
        work.wait()
    host = (mine if everyone is None else torch.cat([mine, everyone])).cpu()
    return StepStats(loss=float(host[LOSS]) / world, grad_norm=float(host[NORM]),
                     stopping=bool(host[STOP] > 0), figures=host[PEAK:mine.numel()],
                     peaks=None if everyone is None else host[mine.numel():].long().tolist())
