"""The host time each unit adds to forward and backward: fullshard, torch's FSDP2, a plain loop.

    OMP_NUM_THREADS=1 python benchmarks/unit_hooks.py [--units 64] [--width 16] [--world-size 1]

A stack of ``--units`` tiny Linear layers, each a unit of its own under fullshard and
under FSDP2 (and the root), and the same stack unsharded: one forward and backward of a
4-row batch each, the three interleaved step by step so that the machine's drift hits all
alike (gloo ranks; at one rank fullshard's collectives are skipped, FSDP2's are not). The
layers are so small that the step is all host time: the figure is the median step's excess
over the plain loop, per unit. G2 on a GPU is this regime with real layers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard.testing import run_distributed

IMPLS = ("fullshard", "fsdp2", "plain")


def _timed(model: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    model(x).sum().backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def _measure(units: int, width: int, steps: int) -> dict[str, float]:
    import fullshard
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    models = {name: nn.Sequential(*[nn.Linear(width, width) for _ in range(units)])
              for name in IMPLS}
    for name, shard in (("fullshard", fullshard.fully_shard), ("fsdp2", torch_fully_shard)):
        for layer in models[name]:
            shard(layer)
        shard(models[name])
    x = torch.randn(4, width)
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    for i in range(steps + 5):
        for name, model in models.items():
            elapsed = _timed(model, x)
            if i >= 5:  # warm-up: lazy init, the first iteration's order
                times[name].append(elapsed)
    # each step's time is the slowest rank's
    medians = {}
    for name, t in times.items():
        slowest = torch.tensor(t)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        medians[name] = statistics.median(slowest.tolist()) * 1e6
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--units", type=int, default=64)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    result = run_distributed(_measure, args.world_size, args.units, args.width, args.steps)[0]
    plain = result["plain"]
    print(f"torch {torch.__version__}, {args.units} units of Linear({args.width}, "
          f"{args.width}), world size {args.world_size}, median of {args.steps} steps")
    print("| impl | forward + backward (us) | per unit over the plain loop (us) |")
    print("|---|---:|---:|")
    for name in IMPLS:
        print(f"| {name} | {result[name]:.0f} | {(result[name] - plain) / args.units:.1f} |")


if __name__ == "__main__":
    main()
