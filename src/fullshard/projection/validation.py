"""The projection judged on sources it never saw (leave-one-source-out), and the error band
every ``fullshard project`` result carries.

Note [leave one source out]
Half of each source's runs fitting the constants and the other half judging them tells how
well the model interpolates between runs of a source it already knows; a user's cluster,
framework and model are a source it has not seen. So each fold fits the constants on every
source but one (``published_runs.csv``'s ``team``), from compute.PRIOR, with the constants
that those sources cannot pin kept at their prior (Note [the prior]), and judges the fold
on the one left out. Pooled over the folds, the held-out |projected / published - 1| of
tokens/s per GPU is the error distribution a new user's run can expect; its ``QUANTILE``
quantile is the band printed around each projection, stored in ``validation.json`` by the
command that measured it (``python benchmarks/projection_published.py --write``), so the
band is data the benchmark regenerates, not a number typed in.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from .compute import KernelConstants
from .fit import fit_constants
from .hardware import ProjectionError
from .published import PublishedRun

VALIDATION = Path(__file__).with_name("validation.json")
QUANTILE = 0.8  # the band holds this share of the held-out runs


@dataclass(frozen=True)
class Fold:
    """One source left out: the constants fitted without it and its runs' errors."""

    team: str
    constants: KernelConstants
    errors: dict[str, float]   # run id: projected / published - 1

    @property
    def median(self) -> float:
        return statistics.median(abs(e) for e in self.errors.values())

    @property
    def worst(self) -> tuple[float, str]:
        return max((abs(e), i) for i, e in self.errors.items())


def leave_one_source_out(runs: list[PublishedRun], iterations: int = 4000,
                         teams: list[str] | None = None) -> list[Fold]:
    """One fold per team of ``runs`` (Note [leave one source out]), or per team of
    ``teams`` only."""
    folds = []
    for team in sorted(teams or {r.team for r in runs}):
        seen = [r for r in runs if r.team != team]
        constants = fit_constants(seen, iterations=iterations)
        folds.append(Fold(team, constants,
                          {r.id: r.error(constants) for r in runs if r.team == team}))
    return folds


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolating between the two nearest."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (at - low) * (ordered[high] - ordered[low])


def pooled(folds: list[Fold]) -> dict[str, float]:
    """Median, mean, worst and the band's quantile of |error| over every held-out run."""
    errors = [abs(e) for f in folds for e in f.errors.values()]
    return {"runs": len(errors), "median": statistics.median(errors),
            "mean": statistics.fmean(errors), "worst": max(errors),
            "band": quantile(errors, QUANTILE)}


@dataclass(frozen=True)
class ErrorBand:
    """Where a published run's tokens/s fell, given the projection's: within ``error`` of
    it for ``quantile`` of the runs from sources left out of the fit."""

    error: float
    quantile: float
    runs: int

    def tokens_per_second(self, projected: float) -> tuple[float, float]:
        """(low, high) of the tokens/s a run projected at ``projected`` reaches:
        |projected / published - 1| <= error."""
        high = projected / (1 - self.error) if self.error < 1 else float("inf")
        return projected / (1 + self.error), high

    def seconds(self, projected: float) -> tuple[float, float]:
        """(low, high) of the step time of a run projected to take ``projected`` seconds."""
        return projected * max(0.0, 1 - self.error), projected * (1 + self.error)


def error_band(path: Path = VALIDATION) -> ErrorBand:
    """The band stored by the last leave-one-source-out run."""
    try:
        data = json.loads(Path(path).read_text())
        return ErrorBand(float(data["band"]["error"]), float(data["band"]["quantile"]),
                         int(data["pooled"]["runs"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ProjectionError(
            f"the projection's validation data {path} is missing or unreadable ({err}); "
            "regenerate it with python benchmarks/projection_published.py --write") from None


def record(folds: list[Fold], command: str, iterations: int) -> dict:
    """What ``validation.json`` holds: the command that measured it, each fold's figures,
    the pooled ones and the band."""
    stats = pooled(folds)
    return {"command": command, "iterations": iterations,
            "folds": {f.team: {"runs": len(f.errors), "median": round(f.median, 4),
                               "worst": round(f.worst[0], 4), "worst_id": f.worst[1],
                               "constants": [round(v, 6) for v in f.constants.as_vector()]}
                      for f in folds},
            "pooled": {k: (v if k == "runs" else round(v, 4)) for k, v in stats.items()},
            "band": {"quantile": QUANTILE, "error": round(stats["band"], 4)}}
