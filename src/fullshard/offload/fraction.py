"""Partial CPU offload: which of a model's repeated blocks keep their shards, gradients
and optimizer states on the host when only a fraction of them should.

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
from typing import Sequence, TypeVar

T = TypeVar("T")


def parse_fraction(text: str) -> float:
    """The fraction in ``cpu:FRACTION`` (text after the colon), in (0, 1]; ``ValueError``
    with a one-line reason otherwise."""
    try:
        fraction = float(text)
    except ValueError:
        raise ValueError(f"cpu:{text} gives no number; write cpu:FRACTION with 0 < FRACTION "
                         "<= 1, e.g. cpu:0.5") from None
    if not 0 < fraction <= 1:  # also rejects nan
        raise ValueError(f"cpu:{text} is outside 0 < FRACTION <= 1; give a fraction of the "
                         "blocks to offload, e.g. cpu:0.5 (cpu alone is cpu:1)")
    return fraction


def offloaded_blocks(blocks: Sequence[T], fraction: float) -> list[T]:
    """The blocks, in model order, that a ``fraction`` offloads: the last
    ceil(fraction * len(blocks)) (Note [which blocks a fraction offloads])."""
    count = min(len(blocks), math.ceil(fraction * len(blocks) - 1e-9))
    return list(blocks[len(blocks) - count:]) if count else []
