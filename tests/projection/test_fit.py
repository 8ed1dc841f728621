"""The fit of the compute model's constants (projection/fit.py): compute.FITTED is a
minimum of the fit half's error."""

from __future__ import annotations

from fullshard.projection import FITTED
from fullshard.projection import fit, published
from fullshard.projection.compute import PRIOR


RUNS = published.load()


def test_the_constants_are_the_minimum_the_fit_found():
    # compute.FITTED is what projection.fit.fit_constants gave on the fit half: moving any
    # one constant that those runs pin 2% either way does not lower the fit half's error
    # (the constants are rounded to four digits, hence the tolerance); the others are the
    # prior's (Note [the prior])
    runs = [r for r in RUNS if r.split == "fit"]
    base = fit.loss(runs, FITTED)
    vector = FITTED.as_vector()
    for i, free in enumerate(fit.pinned(runs)):
        if not free:
            assert vector[i] == PRIOR.as_vector()[i], i
            continue
        for factor in (0.98, 1.02):
            moved = FITTED.from_vector([v * (factor if j == i else 1)
                                        for j, v in enumerate(vector)])
            assert fit.loss(runs, moved) > base - 2e-4, (i, factor)
