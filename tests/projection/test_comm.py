"""Collective times (projection/comm.py): ring all-gather, reduce-scatter and all-reduce."""

from __future__ import annotations

import pytest

from fullshard.projection import Link
from fullshard.projection.comm import collective_seconds


def test_ring_collectives():
    link = Link(bandwidth=10e9, latency=1e-5)
    assert collective_seconds("all_gather", 1e9, 1, link) == 0
    ag = collective_seconds("all_gather", 1e9, 8, link)
    assert ag == pytest.approx(7 * 1e-5 + 7 / 8 * 0.1)
    assert collective_seconds("reduce_scatter", 1e9, 8, link) == pytest.approx(ag)
    assert collective_seconds("all_reduce", 1e9, 8, link) == pytest.approx(2 * ag)
