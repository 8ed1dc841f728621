"""The collectives each warm-up step issues, and whether the last two agree.

A graph replays the captured step's kernels, collectives included, whatever the host
would have decided: a step whose path depends on its data or on a counter (a branch
every k steps, a shape that changes) is replayed wrongly without a word. Two eager
steps that issue the same collectives in the same order are the evidence that the
host's decisions have settled (what the first replay runs is what the next eager step
would have run). Recorded through the one seam every collective passes (Note [one seam
for observing collectives]): warm-up only, nothing is recorded while replaying.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch.distributed as dist

from ..core import comm
from .errors import CaptureError

Entry = tuple  # (kind, process group, async_op)


def record_steps(step_fn: Callable, inputs: Sequence, steps: int,
                 last_step: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                 ) -> list[list[Entry]]:
    """Run ``step_fn(*inputs)`` ``steps`` times; the collectives of each, in order. The
    last runs inside ``last_step()`` (the capture's sync check)."""
    records: list[list[Entry]] = []
    for i in range(steps):
        seen: list[Entry] = []
        context = last_step() if i == steps - 1 else contextlib.nullcontext()
        with comm.observing(lambda kind, group, async_op: seen.append((kind, group, async_op))):
            with context:
                step_fn(*inputs)
        records.append(seen)
    return records


def check_steady(records: list[list[Entry]]) -> None:
    """Refuse when the last two steps issued different collectives (CaptureError)."""
    *_, before, last = records
    if before == last:
        return
    k = next((i for i, (a, b) in enumerate(zip(before, last)) if a != b),
             min(len(before), len(last)))
    n = len(records)
    raise CaptureError(
        f"fullshard.capture_step: warm-up steps {n - 1} and {n} issued different "
        f"collectives (collective {k + 1}: {_named(before, k)}, then {_named(last, k)}): a "
        "CUDA graph replays the captured step's every time; make each step take the same "
        "path (no data-dependent branch, fixed shapes) or run it eagerly")


def _named(entries: list[Entry], k: int) -> str:
    if k >= len(entries):
        return "none"
    kind, group, async_op = entries[k]
    ranks = dist.get_process_group_ranks(group)
    return f"{kind}{' (async)' if async_op else ''} over ranks {ranks}"
