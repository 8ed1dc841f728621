"""Steps of a save or load that ranks take alone, with the outcome agreed on by all.

A checkpoint's save and load alternate between work each rank does alone (creating the
directory on rank 0, writing the manifest, adopting the loaded values) and collectives
(DCP's planning, barriers). A rank whose lone step failed would raise there while the
others waited in the next collective until it died under them: a bare ``OSError`` on
one rank and a raw gloo error on the others, or a hang. ``on_every_rank`` runs a lone
step and then gathers every rank's outcome, so a failure anywhere is one error on every
rank, naming the ranks that failed and how.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .verify import failure


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def on_every_rank(fn: Callable[[], Any], group: dist.ProcessGroup | None = None
                  ) -> tuple[Any, list[tuple[int, str]], BaseException | None]:
    """``(fn()'s result, [(rank, "Type: first line")] of every rank whose fn raised,
    this rank's own error)``; collective over ``group`` when a process group is up."""
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - every kind is reported to every rank
        error = err
    mine = None if error is None else failure(error)
    if not _distributed():
        return result, ([] if error is None else [(0, mine)]), error
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return result, [(r, text) for r, text in enumerate(everyone) if text is not None], error


def failed_ranks(failed: list[tuple[int, str]]) -> str:
    """``rank 0: OSError: ...; rank 1: ...`` for an error message."""
    return "; ".join(f"rank {r}: {text}" for r, text in failed)


def dcp_failures(err: BaseException) -> list[tuple[int, str]]:
    """The ranks DCP's ``CheckpointException`` names, each with its first error."""
    if isinstance(err, CheckpointException) and err.failures:
        return [(r, failure(e[0] if isinstance(e, tuple) else e))
                for r, e in sorted(err.failures.items())]
    return [(dist.get_rank() if _distributed() else 0, failure(err))]
