"""One step's timeline (projection/timeline.py): communication hidden under compute
where it is shorter, the step bound by it where it is longer; what sets a projected step
(StepTime.terms, StepTime.dominant) on cases built so that each term dominates."""

from __future__ import annotations

import pytest

from fullshard.projection import FITTED, SHAPES, Cluster, ModelShape, Settings, device_named
from fullshard.projection import project, published
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


def test_exposed_time_is_told_apart_by_what_the_compute_waited_for():
    # the first gather and the last unit's re-gather hold compute back; the last
    # reduction holds the step's end
    t = step_time(_units(8, compute=1.0, comm=0.3), 1, optimizer=0.0, overlaps=True)
    assert t.exposed_gather == pytest.approx(0.6)
    assert t.exposed_reduce == pytest.approx(0.3)
    assert sum(t.terms().values()) == pytest.approx(t.seconds)
    serial = step_time(_units(8, compute=1.0, comm=0.3), 1, 0.0, overlaps=False)
    assert (serial.exposed_gather, serial.exposed_reduce) == pytest.approx((4.8, 2.4))
    assert sum(serial.terms().values()) == pytest.approx(serial.seconds)


def test_host_overhead_is_carried_apart_from_the_compute_it_is_part_of():
    units = [UnitCost(forward=1.0, backward=2.0, gather=0.0, regather=0.0, reduce=0.0,
                      overhead=2.5) for _ in range(4)]
    t = step_time(units, 3, optimizer=0.5, overlaps=True)
    assert t.compute == pytest.approx(3 * 4 * 3.0 + 0.5)
    assert t.overhead == pytest.approx(3 * 4 * 2.5)
    assert t.terms()["compute"] == pytest.approx(t.compute - t.overhead)
    assert t.dominant() == "host overhead"


# -- what sets a projected step -------------------------------------------------------------
H100 = device_named("h100")
TINY = ModelShape("tiny", 256, 4, 4, 4, 1024, 32000, False, True)


@pytest.mark.parametrize("shape, cluster, settings, dominant", [
    # a tiny model at a huge world: waiting on its gathers, then on its reductions
    (TINY, Cluster(H100, 1024, 8), Settings("full_shard", 1, 2048), "exposed all-gather"),
    (TINY, Cluster(H100, 1024, 8), Settings("no_shard", 1, 2048), "exposed reduce-scatter"),
    # a huge model on one GPU: nothing to wait for
    (SHAPES["llama3-70b"], Cluster(H100, 1, 1), Settings("full_shard", 4, 8192), "compute"),
    # many tiny units: their launches and hooks, not their kernels
    (ModelShape("many", 64, 200, 1, 1, 256, 1000, False, True), Cluster(H100, 1, 1),
     Settings("full_shard", 1, 256), "host overhead"),
])
def test_the_dominant_term_is_named(shape, cluster, settings, dominant):
    t = project(shape, cluster, settings).time
    assert t.dominant() == dominant, t.terms()
    terms = t.terms()
    assert terms[dominant] > 0.5 * t.seconds


def test_the_terms_make_up_every_published_step_and_overhead_is_the_fitted_one():
    for r in published.load()[::7]:
        t = r.projection().time
        assert sum(t.terms().values()) == pytest.approx(t.seconds, rel=1e-9), r.id
        assert min(t.terms().values()) >= -1e-12, r.id
    # one micro-batch of llama3-8b, no checkpointing: every unit (embedding, 32 blocks,
    # head) pays the overhead once forward and twice backward
    t = project(SHAPES["llama3-8b"], Cluster(H100, 8, 8), Settings("full_shard", 1, 2048)).time
    assert t.overhead == pytest.approx(34 * 3 * FITTED.unit_overhead)
    full = project(SHAPES["llama3-8b"], Cluster(H100, 8, 8),
                   Settings("full_shard", 1, 2048, 1, "full")).time
    assert full.overhead == pytest.approx(t.overhead + 32 * FITTED.unit_overhead)
