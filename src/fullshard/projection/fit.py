"""Fitting the compute model's constants (compute.KernelConstants) to published runs.

``fit_constants(runs)`` minimizes the mean absolute log error of projected tokens/s per GPU
over ``runs`` (the fit half of published_runs.csv: ``published.load()`` rows whose split is
"fit"), by Nelder-Mead over the constants' logarithms, from compute.PRIOR; a constant whose
term takes too small a share of the steps of ``runs`` to be pinned by them keeps its prior
value (``pinned``, Note [the prior]). How
compute.FITTED was made:

    python -m fullshard.projection.fit        # prints the constants and both halves' errors

The absolute (not squared) error keeps one run that published an odd number (a busy
cluster, a memory-starved allocator) from pulling every constant towards it.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from .compute import FITTED, PRIOR, KernelConstants
from .published import PublishedRun, load


def loss(runs: list[PublishedRun], constants: KernelConstants) -> float:
    """Mean |log(projected / published)| of tokens/s per GPU over ``runs``."""
    return statistics.fmean(abs(math.log1p(r.error(constants))) for r in runs)


def _bounded(constants: KernelConstants) -> bool:
    # fractions of a datasheet figure stay below it
    ok = all(0 < v <= 1 for v in [*constants.matmul.values(), *constants.attention.values(),
                                  constants.flash1, constants.compile_saving])
    return ok and all(v > 0 for v in constants.as_vector())


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float = 0.1,
                iterations: int = 4000, tolerance: float = 1e-7) -> list[float]:
    """Minimize ``f`` from ``x0``: the adaptive Nelder-Mead of Gao and Han (2012).
    Hand-written because this one offline fit is all fullshard would use SciPy for."""
    n = len(x0)
    alpha, gamma, rho, sigma = 1.0, 1 + 2 / n, 0.75 - 1 / (2 * n), 1 - 1 / n
    simplex = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)]
                            for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tolerance:
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        point = lambda t: [c + t * (c - w) for c, w in zip(centroid, worst)]  # noqa: E731
        reflected = point(alpha)
        fr = f(reflected)
        if fr < values[0]:
            expanded = point(gamma)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            inside = fr >= values[-1]
            contracted = point(-rho if inside else rho * alpha)
            fc = f(contracted)
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best
                best = simplex[0]
                simplex = [best] + [[b + sigma * (x - b) for b, x in zip(best, p)]
                                    for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


# Note [the prior]: a constant is pinned by the runs fitted when its term takes at least
# PIN_SHARE of the step in at least PIN_RUNS of them. The published figures scatter by about
# 3% around any smooth model (the median error on runs of sources the fit knows), so a term
# must take about a tenth of a step before a 30% change of its constant stands out of that
# scatter; and three runs, so that one odd run cannot set a constant alone.
PIN_SHARE, PIN_RUNS = 0.10, 3


def term_shares(run: PublishedRun, constants: KernelConstants = PRIOR) -> list[float]:
    """For each of ``constants.as_vector()``: the share of ``run``'s projected step its
    term takes, |d log step / d log constant| (a 1% nudge)."""
    base = constants.as_vector()
    step = run.projection(constants).time.seconds
    shares = []
    for i in range(len(base)):
        nudged = constants.from_vector([v * (1.01 if j == i else 1) for j, v in enumerate(base)])
        shares.append(abs(math.log(run.projection(nudged).time.seconds / step)
                          / math.log(1.01)))
    return shares


def pinned(runs: list[PublishedRun], constants: KernelConstants = PRIOR) -> list[bool]:
    """For each of ``constants.as_vector()``: whether ``runs`` can pin it, i.e. its term
    takes PIN_SHARE of the step (at ``constants``) in PIN_RUNS of them. One they cannot pin
    keeps its prior (Note [the prior]): e.g. the GPT-style block's elementwise passes
    when only Llama-style runs are fitted, or the loss when their vocabularies are small."""
    counts = [0] * len(constants.as_vector())
    for r in runs:
        counts = [n + (share >= PIN_SHARE) for n, share in zip(counts, term_shares(r, constants))]
    return [n >= PIN_RUNS for n in counts]


def fit_constants(runs: list[PublishedRun], start: KernelConstants = PRIOR,
                  iterations: int = 4000) -> KernelConstants:
    """The constants minimizing ``loss`` over ``runs``, searched from ``start``; those that
    ``runs`` cannot pin (``pinned``) stay at ``start``'s values."""
    base = start.as_vector()
    free = [i for i, ok in enumerate(pinned(runs, start)) if ok]

    def constants(logs: list[float]) -> KernelConstants:
        values = list(base)
        for i, v in zip(free, logs):
            values[i] = math.exp(v)
        return start.from_vector(values)

    def objective(logs: list[float]) -> float:
        c = constants(logs)
        return loss(runs, c) if _bounded(c) else math.inf

    if not free:
        return start
    return constants(nelder_mead(objective, [math.log(base[i]) for i in free],
                                 iterations=iterations))


def report(runs: list[PublishedRun], constants: KernelConstants = FITTED) -> dict[str, dict]:
    """{split: {"runs", "median", "worst", "worst_id"}} of |projected / published - 1|."""
    out = {}
    for split in ("fit", "held-out"):
        rows = [(abs(r.error(constants)), r.id) for r in runs if r.split == split]
        worst = max(rows)
        out[split] = {"runs": len(rows), "median": statistics.median(e for e, _ in rows),
                      "worst": worst[0], "worst_id": worst[1]}
    return out


def main() -> None:
    runs = load()
    fitted = fit_constants([r for r in runs if r.split == "fit"])
    print(fitted)
    for split, stats in report(runs, fitted).items():
        print(f"{split}: {stats['runs']} runs, median {stats['median']:.1%}, worst "
              f"{stats['worst']:.1%} ({stats['worst_id']})")


if __name__ == "__main__":
    main()
