"""Partial offload: which of a model's repeated blocks keep their shards, gradients and
optimizer states on the host (``cpu:FRACTION``), or their states in files
(``disk:PATH:FRACTION``), when only a fraction of them should.

Note [which blocks a fraction offloads]
A fraction f of L blocks offloads the last ceil(f * L) of them; the embeddings, head and
root stay on the device unless f is 1 (then everything goes, as ``cpu`` does). The last
blocks because both ends of a step favour them: backward reduces their gradients first,
so their device-to-host copies and host work start while the device-resident earlier
blocks still run backward; and the next forward gathers the first blocks first, so it
starts without a host-to-device copy, giving the copies of the later, offloaded blocks
time to arrive. Rounding up means any f > 0 offloads at least one block. It allows 1e-9
below an integer because a fraction written as the shortest text of k / L (what
``fullshard plan`` prints) can read back a hair above it: 0.28 x 25 is
7.000000000000001, and a bare ceil would offload 8 of 25 blocks for cpu:0.28.
"""

from __future__ import annotations

import math
import os
from typing import Sequence, TypeVar

T = TypeVar("T")


def parse_fraction(text: str, written: str | None = None, form: str = "cpu:FRACTION",
                   example: str = "cpu:0.5") -> float:
    """The fraction in ``cpu:FRACTION`` (``text``: what follows the last colon), in
    (0, 1]; ``ValueError`` with a one-line reason otherwise, naming the offload as
    ``written`` (default ``cpu:TEXT``) and showing its ``form`` and an ``example``."""
    written = written or f"cpu:{text}"
    try:
        fraction = float(text)
    except ValueError:
        raise ValueError(f"{written} gives no number; write {form} with 0 < FRACTION "
                         f"<= 1, e.g. {example}") from None
    if not 0 < fraction <= 1:  # also rejects nan
        kind = form.partition(":")[0]
        raise ValueError(f"{written} is outside 0 < FRACTION <= 1; give a fraction of the "
                         f"blocks to offload, e.g. {example} ({kind} alone is all of them)")
    return fraction


def disk_path_and_fraction(text: str) -> tuple[str, float]:
    """The directory and the fraction of the blocks in ``disk:PATH`` or
    ``disk:PATH:FRACTION`` (``text``: what follows ``disk:``). A ``text`` that names a
    directory is the path whole, colons and all; otherwise a last ``:`` followed by a
    number separates the fraction (``ValueError`` when it is outside (0, 1]). Whether the
    directory exists is for the caller to check."""
    if os.path.isdir(text):
        return text, 1.0
    path, colon, tail = text.rpartition(":")
    if colon and path and _is_number(tail):
        return path, parse_fraction(tail, f"disk:{text}", "disk:PATH:FRACTION",
                                    "disk:/nvme/states:0.5")
    return text, 1.0


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def offloaded_blocks(blocks: Sequence[T], fraction: float) -> list[T]:
    """The blocks, in model order, that a ``fraction`` offloads: the last
    ceil(fraction * len(blocks)) (Note [which blocks a fraction offloads])."""
    count = min(len(blocks), math.ceil(fraction * len(blocks) - 1e-9))
    return list(blocks[len(blocks) - count:]) if count else []
