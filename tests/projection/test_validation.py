"""The projection judged on sources it never saw (projection/validation.py, Note [leave one
source out]): fits that start from compute.PRIOR and keep it where the fitted runs cannot
pin a constant, the stored figures being what their fitted constants give, and the band
printed around every projection."""

from __future__ import annotations

import json
import statistics

import pytest

from fullshard.projection import FITTED, ProjectionError, fit, published, validation
from fullshard.projection.compute import PRIOR

from support.catalogue import matches_documented

RUNS = published.load()
STORED = json.loads(validation.VALIDATION.read_text())


NAMES = ["matmul ampere", "matmul hopper", "attention ampere", "attention hopper",
         "elementwise gpt", "elementwise llama", "loss_bytes", "unit_overhead", "flash1",
         "compile_saving"]


def test_a_constant_is_pinned_only_by_runs_whose_steps_its_term_takes_a_share_of():
    # the Llama-style sources: no GPT-style block, 32k-128k vocabularies at long sequences
    # (the loss a few percent of a step), large units (the overhead too), and SDPA's
    # second-generation flash attention only; every compiled run is one of theirs
    llama_only = [r for r in RUNS if r.team != "MosaicML"]
    assert dict(zip(NAMES, fit.pinned(llama_only))) == {
        **dict.fromkeys(NAMES, True), "elementwise gpt": False, "loss_bytes": False,
        "unit_overhead": False, "flash1": False}
    # two compiled runs cannot pin compilation's saving (Note [the prior]): three can
    compiled = [r for r in RUNS if r.settings.compile != "none"]
    assert [fit.pinned(compiled[:n])[9] for n in (2, 3)] == [False, True]
    ampere = [r for r in RUNS if r.cluster.device.arch == "ampere"]
    free = dict(zip(NAMES, fit.pinned(ampere)))
    assert not free["matmul hopper"] and not free["attention hopper"] and free["matmul ampere"]
    # the overhead takes a tenth of the step in fewer than three runs at the prior (whose
    # first-generation attention is slower than the fit's): every run cannot pin it either
    assert dict(zip(NAMES, fit.pinned(RUNS))) == {**dict.fromkeys(NAMES, True),
                                                  "unit_overhead": False}
    shares = fit.term_shares(ampere[0])
    assert shares[1] == shares[3] == 0.0 and 0.3 < shares[0] < 1.0
    # a first-generation kernel's ratio scales its attention: the same share, counted once
    assert ampere[0].settings.attention == "flash1" and shares[8] == pytest.approx(shares[2])
    assert sum(shares[:8]) < 1.01  # shares of one step
    assert fit.term_shares(llama_only[0])[8] == 0.0
    # compilation's saving moves compiled and hand-fused runs only
    assert shares[9] == 0.0 and fit.term_shares(compiled[0])[9] > fit.PIN_SHARE
    fused = [r for r in RUNS if r.settings.kernels == "fused"]
    assert fused and fit.term_shares(fused[0])[9] > fit.PIN_SHARE


def test_a_fit_starts_from_the_prior_and_keeps_it_where_the_runs_cannot_pin_it():
    # fitted on the Llama-style sources only: the GPT-style block's passes, the loss and
    # the overhead are the prior's, not compute.FITTED's (which MosaicML's runs fitted)
    llama_only = [r for r in RUNS if r.team != "MosaicML"]
    c = fit.fit_constants(llama_only, iterations=60)
    assert c.elementwise["gpt"] == PRIOR.elementwise["gpt"] != FITTED.elementwise["gpt"]
    assert (c.loss_bytes, c.unit_overhead) == (PRIOR.loss_bytes, PRIOR.unit_overhead)
    assert c.elementwise["llama"] != PRIOR.elementwise["llama"]  # this one it fitted
    assert fit.loss(llama_only, c) < fit.loss(llama_only, PRIOR)


@pytest.mark.slow
def test_the_stored_folds_are_what_their_constants_give_on_the_source_left_out():
    teams = {r.team for r in RUNS}
    assert set(STORED["folds"]) == teams
    pooled = []
    for team, fold in STORED["folds"].items():
        constants = PRIOR.from_vector(fold["constants"])
        errors = [abs(r.error(constants)) for r in RUNS if r.team == team]
        assert fold["runs"] == len(errors)
        assert fold["median"] == pytest.approx(statistics.median(errors), abs=2e-4), team
        assert fold["worst"] == pytest.approx(max(errors), abs=2e-4), team
        # what the other sources cannot pin is the prior's value, never a fitted one
        seen = [r for r in RUNS if r.team != team]
        for value, prior, free in zip(fold["constants"], PRIOR.as_vector(),
                                      fit.pinned(seen)):
            if not free:
                assert value == pytest.approx(prior, rel=1e-6), team
        pooled += errors
    assert STORED["pooled"]["runs"] == len(RUNS) == len(pooled)
    assert STORED["pooled"]["median"] == pytest.approx(statistics.median(pooled), abs=2e-4)
    assert STORED["pooled"]["worst"] == pytest.approx(max(pooled), abs=2e-4)
    assert STORED["band"]["error"] == pytest.approx(
        validation.quantile(pooled, validation.QUANTILE), abs=2e-4)
    assert STORED["command"].startswith("python benchmarks/projection_published.py --write")


def test_one_fold_alone_leaves_out_its_source_only():
    # benchmarks/projection_published.py --fold: the same fold as in the whole run
    runs = [r for r in RUNS if r.team in ("IBM (fms-fsdp)", "Meta (torchtitan)")]
    (fold,) = validation.leave_one_source_out(runs, iterations=20, teams=["IBM (fms-fsdp)"])
    assert fold.team == "IBM (fms-fsdp)"
    assert set(fold.errors) == {r.id for r in runs if r.team == "IBM (fms-fsdp)"}
    assert fold.constants == fit.fit_constants(
        [r for r in runs if r.team == "Meta (torchtitan)"], iterations=20)


def test_quantiles_interpolate_between_the_nearest_values():
    assert validation.quantile([3.0, 1.0, 2.0, 4.0, 5.0], 0.5) == 3.0
    assert validation.quantile([0.0, 10.0], 0.8) == pytest.approx(8.0)
    assert validation.quantile([1.0, 2.0], 1.0) == 2.0


@pytest.mark.parametrize("error", [0.0, 0.05, 0.3, 0.99, 1.0, 2.5])
def test_the_band_brackets_the_projection(error):
    band = validation.ErrorBand(error, 0.8, 230)
    low, high = band.tokens_per_second(1000.0)
    assert low <= 1000.0 <= high
    assert (low, high) == pytest.approx((1000 / (1 + error), 1000 / (1 - error)
                                         if error < 1 else float("inf")))
    low, high = band.seconds(2.0)
    assert 0.0 <= low <= 2.0 <= high


def test_the_stored_band_is_read():
    band = validation.error_band()
    assert (band.error, band.quantile, band.runs) == (
        STORED["band"]["error"], validation.QUANTILE, len(RUNS))


def test_a_missing_band_is_one_line_saying_how_to_make_it(tmp_path):
    for path in (tmp_path / "gone.json", tmp_path / "bad.json"):
        if path.name == "bad.json":
            path.write_text('{"band": {}}')
        with pytest.raises(ProjectionError) as err:
            validation.error_band(path)
        message = f"ProjectionError: {err.value}"
        assert matches_documented("E310", message) and "\n" not in message, message
