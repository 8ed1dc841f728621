"""The host time the optimizer step hooks add (Note [optimizer steps on local shards]).

    OMP_NUM_THREADS=1 python benchmarks/step_hooks.py [--params 400] [--steps 50]

One rank (gloo). A stack of tiny Linear layers (``--params`` parameters in all, each a
unit of its own) whose step is all host overhead: the same SGD step timed over the
fullshard parameters (the hooks swap each for its local shard and back) and over plain
parameters of the same shapes (no hook has anything to do), steps interleaved one by one
so the machine's drift hits both alike. Prints the median of each and their difference,
the hooks' cost per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.testing import run_distributed


def _model(params: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(params // 2)])


def _timed(opt: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def _measure(params: int, steps: int) -> dict:
    torch.manual_seed(0)
    sharded, plain = _model(params), _model(params)
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    opts = {"fullshard": torch.optim.SGD(sharded.parameters(), lr=0.1, foreach=True),
            "plain": torch.optim.SGD(plain.parameters(), lr=0.1, foreach=True)}
    x = torch.randn(2, 4)
    for model in (sharded, plain):
        model(x).sum().backward()  # gradients stay: each step reads the same ones
    times: dict[str, list[float]] = {name: [] for name in opts}
    for i in range(steps + 5):
        for name, opt in opts.items():
            elapsed = _timed(opt)
            if i >= 5:  # warm-up
                times[name].append(elapsed)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=400)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    (result,) = run_distributed(_measure, 1, args.params, args.steps)
    print(f"torch {torch.__version__}, {args.params} parameters, median of {args.steps} steps")
    print(f"opt.step() on fullshard parameters: {result['fullshard']:.0f} us")
    print(f"opt.step() on plain parameters:     {result['plain']:.0f} us")
    print(f"the hooks' cost per step:           {result['fullshard'] - result['plain']:.0f} us")


if __name__ == "__main__":
    main()
