"""The projection against the published FSDP runs of src/fullshard/projection/published_runs.csv.

The headline: leave-one-source-out (Note [leave one source out], projection/validation.py).
For each team, the constants are fitted from compute.PRIOR on every other team's runs and
judged on that team's; it prints each fold's median and worst |projected / published - 1|
of tokens/s per GPU and the pooled median, mean and worst over all held-out runs (about
two minutes per fold on two cores; ``--iterations`` shortens the fits, ``--write`` stores
the figures and the error band of ``fullshard project`` in
src/fullshard/projection/validation.json).

Then the second figure: every run projected with compute.FITTED (fitted on the fit half of
every source), per split and per (team, GPU), the runs beyond 20%, and the memory check
(every run ran: none may be projected over its GPU's memory):

    python benchmarks/projection_published.py [--runs] [--check] [--write] [--no-loso]

``--fold TEAM`` runs that fold alone (a pooled figure over it only; nothing stored).
``--runs`` prints every run; ``--check`` exits 1 when the split's held-out median exceeds
5%, a held-out run other than those in KNOWN_MISSES is off by more than 20%, or a run is
projected not to fit (the leave-one-source-out goal is reported, not checked: it is not
met, docs/projection.md). ``--refit`` fits the constants again on the fit half first
(about two minutes) and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from fullshard.projection import FITTED, fit, published, validation  # noqa: E402

# Held-out runs beyond 20% (docs/projection.md, "What it misses"): three are runs their own
# source reports 15-27% slower than the same model at a neighbouring GPU count or
# micro-batch, which no smooth model follows; fms-fsdp's Llama 2 13B at micro-batch 1
# (HYBRID_SHARD, 128 A100s) is a small micro-batch, where one per-unit overhead for every
# framework is weakest (its leave-one-source-out fold misses it by as much).
KNOWN_MISSES = {"mpt-70b-a100-40gb-g64-s2048-mb2", "mpt-30b-h100-g8-s8192-mb1",
                "mpt-1b-a100-40gb-g32-s2048-mb10", "fms-a100-llama2-13b-hsdp-b1"}
GOAL_MEDIAN, GOAL_WORST = 0.05, 0.20
ITERATIONS = 4000  # fit.fit_constants' own default


def summary(runs: list[published.PublishedRun], constants=FITTED) -> dict:
    """Errors per split and per (split, team, GPU), the held-out runs beyond 20%, and the
    runs projected over their GPUs' memory."""
    errors = {r.id: r.error(constants) for r in runs}
    groups = defaultdict(list)
    for r in runs:
        groups[(r.split, r.team, r.cluster.device.name)].append(abs(errors[r.id]))
        groups[(r.split, "all", "")].append(abs(errors[r.id]))
    over_memory = [r.id for r in runs if not r.projection(constants).fits(margin=0.0)]
    beyond = sorted(r.id for r in runs
                    if r.split == "held-out" and abs(errors[r.id]) > GOAL_WORST)
    return {"errors": errors, "groups": dict(groups), "beyond": beyond,
            "over_memory": over_memory}


def leave_one_source_out(runs: list[published.PublishedRun], iterations: int,
                         write: bool, teams: list[str] | None = None) -> None:
    """Print the folds and the pooled figures; with ``write``, store them."""
    started = time.perf_counter()
    folds = validation.leave_one_source_out(runs, iterations, teams)
    print(f"leave-one-source-out ({iterations} Nelder-Mead iterations per fold, "
          f"{time.perf_counter() - started:,.0f} s)")
    print(f"{'held-out source':<26} {'runs':>4} {'median':>7} {'worst':>7}  worst run")
    for f in folds:
        worst, worst_id = f.worst
        print(f"{f.team:<26} {len(f.errors):>4} {f.median:>7.1%} {worst:>7.1%}  {worst_id}")
    stats = validation.pooled(folds)
    print(f"pooled: {stats['runs']} runs, median {stats['median']:.1%}, mean "
          f"{stats['mean']:.1%}, worst {stats['worst']:.1%}; {validation.QUANTILE:.0%} within "
          f"{stats['band']:.1%} (goal: median {GOAL_MEDIAN:.0%}, worst {GOAL_WORST:.0%}: "
          f"{'met' if stats['median'] <= GOAL_MEDIAN and stats['worst'] <= GOAL_WORST else 'not met'})")
    if write:
        command = "python benchmarks/projection_published.py --write" + (
            f" --iterations {iterations}" if iterations != ITERATIONS else "")
        validation.VALIDATION.write_text(
            json.dumps(validation.record(folds, command, iterations), indent=1) + "\n")
        print(f"written: {validation.VALIDATION}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", action="store_true", help="print every run")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless the held-out figures are as documented")
    parser.add_argument("--refit", action="store_true", help="fit the constants again first")
    parser.add_argument("--no-loso", action="store_true",
                        help="skip the leave-one-source-out folds (the slow part)")
    parser.add_argument("--iterations", type=int, default=ITERATIONS,
                        help="Nelder-Mead iterations per leave-one-source-out fit")
    parser.add_argument("--write", action="store_true",
                        help="store the leave-one-source-out figures and error band")
    parser.add_argument("--fold", action="append", metavar="TEAM",
                        help="only the fold leaving out TEAM (a team of the CSV; repeatable): "
                             "for trying a change on one source, never with --write")
    args = parser.parse_args()
    runs = published.load()
    teams = sorted({r.team for r in runs})
    if args.fold and (args.write or set(args.fold) - set(teams)):
        parser.error("--fold takes teams of the CSV (" + "; ".join(teams) + ") and stores "
                     "nothing: --write needs every fold")
    if not args.no_loso:
        leave_one_source_out(runs, args.iterations, args.write, args.fold)
    constants = FITTED
    if args.refit:
        constants = fit.fit_constants([r for r in runs if r.split == "fit"])
        print(f"refitted: {constants}")
    s = summary(runs, constants)
    if args.runs:
        for r in runs:
            p = r.projection(constants)
            print(f"{r.split:<8} {r.id:<44} published {r.tokens_per_second:>9,.0f} projected "
                  f"{p.tokens_per_second_per_device:>9,.0f} {s['errors'][r.id]:+7.1%} "
                  f"memory {p.memory_bytes / p.device_memory_bytes:4.0%}")
    print(f"{'split':<9} {'team':<26} {'GPU':<11} {'runs':>4} {'median':>7} {'worst':>7}")
    for (split, team, gpu), errs in sorted(s["groups"].items()):
        print(f"{split:<9} {team:<26} {gpu:<11} {len(errs):>4} "
              f"{statistics.median(errs):>7.1%} {max(errs):>7.1%}")
    print(f"held-out runs beyond {GOAL_WORST:.0%}: {', '.join(s['beyond']) or 'none'}")
    print(f"runs projected over their GPUs' memory: {', '.join(s['over_memory']) or 'none'}")
    if args.check:
        median = statistics.median(s["groups"][("held-out", "all", "")])
        problems = ([f"held-out median {median:.1%} > {GOAL_MEDIAN:.0%}"]
                    if median > GOAL_MEDIAN else []) \
            + [f"{i} beyond {GOAL_WORST:.0%}" for i in s["beyond"] if i not in KNOWN_MISSES] \
            + [f"{i} projected not to fit" for i in s["over_memory"]]
        if problems:
            print("check failed: " + "; ".join(problems))
            sys.exit(1)


if __name__ == "__main__":
    main()
