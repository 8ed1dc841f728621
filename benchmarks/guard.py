"""What the divergence guard costs per step at 2, 3 and 4 gloo ranks (CPU), and what it
sends whatever the world size.

    OMP_NUM_THREADS=1 python benchmarks/guard.py
    OMP_NUM_THREADS=1 python benchmarks/guard.py --sizes 2,4 --steps 200

One comparison on the control channel is one all-reduce (MAX) of ten int64s: 80 bytes
a rank at any world size (core/guard/divergence.py, Note [ranks agree on every collective]).
Per world size, the median microseconds of a training step (forward, backward, SGD) of a
4-unit model with the guard off, comparing through the digests its reductions carry
(CPU's default: no exchange), and comparing once a step on the control channel, left in
flight until the next step settles (Note [a comparison one step behind]: what an
accelerator does). The modes take turns within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.core.guard import divergence
from fullshard.core.state import unit_of
from fullshard.testing import run_distributed


def _sharded():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.ones(2, 64)).sum().backward()  # lazy init: the root's guard exists
    return model


def _timed(fn, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - started) / steps * 1e6


def _modes(model):
    """Switch the root's guard: off, comparing through the reductions' digests (CPU's
    way), or one comparison a step left in flight (an accelerator's way)."""
    root = unit_of(model).root
    guard = root.guard

    def use(mode: str) -> None:
        root.guard = None if mode == "off" else guard
        for group in root.members:
            group.guard = root.guard
        guard.lagged = mode == "in flight"
        guard.channel.drain()
    return use


def _measure(steps: int, rounds: int = 5) -> dict:
    model = _sharded()
    use = _modes(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.ones(2, 64)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    times: dict[str, list[float]] = {"off": [], "digests": [], "in flight": []}
    for _ in range(rounds):  # the modes take turns: a slow spell falls on all of them
        for mode in times:
            use(mode)
            for _ in range(3):
                step()
            times[mode].append(_timed(step, steps // rounds))
    use("digests")
    return {mode: statistics.median(t) for mode, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,3,4")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    sent = 2 * divergence._FIELDS * 8  # the fields and their negatives, int64
    print(f"| ranks | step, guard off (µs) | digests in the reductions | one comparison "
          f"({sent} bytes a rank) in flight | ratios to off |")
    print("|---:|---:|---:|---:|---:|")
    for n in map(int, args.sizes.split(",")):
        r = run_distributed(_measure, n, args.steps, timeout=600)[0]
        print(f"| {n} | {r['off']:.0f} | {r['digests']:.0f} | {r['in flight']:.0f} | "
              f"{r['digests'] / r['off']:.2f}, {r['in flight'] / r['off']:.2f} |")


if __name__ == "__main__":
    main()
