"""What sets a projected step (StepTime.terms, StepTime.dominant): compute, host overhead,
exposed all-gather, exposed reduce-scatter, on cases built so that each one dominates."""

from __future__ import annotations

import pytest

from fullshard.projection import FITTED, SHAPES, Cluster, ModelShape, Settings, device_named
from fullshard.projection import project, published

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
