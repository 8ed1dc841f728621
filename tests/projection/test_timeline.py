"""One step's timeline (projection/timeline.py): communication hidden under compute
where it is shorter, the step bound by it where it is longer."""

from __future__ import annotations

import pytest

from fullshard.projection.timeline import UnitCost, step_time


def _units(n, compute, comm):
    return [UnitCost(forward=compute, backward=2 * compute, gather=comm, regather=comm,
                     reduce=comm) for _ in range(n)]


def test_timeline_hides_communication_shorter_than_compute():
    units = _units(8, compute=1.0, comm=0.3)
    t = step_time(units, 1, optimizer=0.0, overlaps=True)
    assert t.compute == pytest.approx(24.0)
    # sticking out: the first gather, the last unit's re-gather as backward begins, and
    # the last reduction
    assert t.exposed == pytest.approx(0.9)
    units[-1] = UnitCost(1.0, 2.0, gather=0.3, regather=0.0, reduce=0.3)  # kept gathered
    assert step_time(units, 1, 0.0, True).exposed == pytest.approx(0.6)
    serial = step_time(units, 1, optimizer=0.0, overlaps=False)
    assert serial.seconds == pytest.approx(24.0 + 8 * 0.9 - 0.3)


def test_timeline_is_bound_by_communication_longer_than_compute():
    units = _units(8, compute=0.1, comm=1.0)
    t = step_time(units, 1, optimizer=0.0, overlaps=True)
    assert t.seconds >= t.communication and t.seconds < t.communication + t.compute
