"""The projection against fullshard runs measured on this machine (CPU, gloo).

Calibrates as `fullshard project --calibrate` does (a plain single-process step of the
model, memory bandwidth, a gloo sweep of fullshard's collectives at each world size),
projects a full_shard step at each world size, then trains fullshard at those world sizes
(one `fully_shard` per block and the root, AdamW, fp32) and prints projected, measured and
their ratio:

    OMP_NUM_THREADS=1 python benchmarks/projection_cpu.py [--world-sizes 1,2,4] [--d-model 256]
        [--check 0.15]

With ``--check TOL`` it exits 1 when a projection is off by more than TOL (a fraction) of
the measured time: `make bench-projection` runs it so. The check is a measurement of this
machine, not a unit test: on a shared machine the measured side moves by more than 15%
from run to run, which is why `make test` does not run it (tests/projection/test_calibrate.py
checks the comparison itself, within a factor that load cannot reach).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from fullshard.gpt import GPT, GPTConfig  # noqa: E402
from fullshard.projection import Cluster, Settings, project, shape_of  # noqa: E402
from fullshard.projection.calibrate import (achieved_flops, calibrated_cpu, fit_link,  # noqa: E402
                                            median_step_seconds, memory_bandwidth,
                                            sweep_collectives)
from fullshard.testing import run_distributed  # noqa: E402


def train_steps(cfg: GPTConfig, batch: int, seq: int, steps: int, warmup: int) -> float:
    """Median seconds per fullshard step on this rank (run under run_distributed)."""
    import torch.distributed as dist

    from fullshard import fully_shard

    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1),
                      generator=torch.Generator().manual_seed(dist.get_rank()))
    return median_step_seconds(model, x, steps, warmup, before_each=dist.barrier)


def compare(cfg: GPTConfig, batch: int, seq: int, world_sizes: list[int], steps: int = 6,
            warmup: int = 2) -> list[dict]:
    flops = run_distributed(achieved_flops, 1, cfg, batch, seq)[0]  # a process of its own
    bandwidth = memory_bandwidth()
    shape = shape_of(cfg, "gpt")
    rows = []
    for ws in world_sizes:
        link = fit_link(run_distributed(sweep_collectives, max(ws, 2))[0])
        device = calibrated_cpu(flops, link, bandwidth)
        projected = project(shape, Cluster(device, ws, ws), Settings("full_shard", batch, seq,
                                                                        param_bytes=4))
        measured = max(run_distributed(train_steps, ws, cfg, batch, seq, steps, warmup))
        rows.append({"world_size": ws, "projected_s": projected.time.seconds,
                     "measured_s": measured, "ratio": projected.time.seconds / measured,
                     "comm_s": projected.time.communication})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--check", type=float, default=None, metavar="TOL",
                        help="exit 1 if any |projected / measured - 1| exceeds TOL")
    args = parser.parse_args()
    cfg = GPTConfig(vocab_size=512, seq_len=args.seq, d_model=args.d_model,
                    n_layers=args.layers, n_heads=4)
    print(f"GPT d_model {args.d_model}, {args.layers} layers, {cfg.num_params() / 1e6:.2f}M "
          f"parameters, batch {args.batch} x {args.seq} per rank, {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'projected s':>12} {'measured s':>11} {'ratio':>6} {'comm s':>8}")
    rows = compare(cfg, args.batch, args.seq, [int(w) for w in args.world_sizes.split(",")])
    for r in rows:
        print(f"{r['world_size']:>5} {r['projected_s']:>12.4f} {r['measured_s']:>11.4f} "
              f"{r['ratio']:>6.2f} {r['comm_s']:>8.4f}")
    off = [r for r in rows if args.check is not None and abs(r["ratio"] - 1) > args.check]
    if off:
        print(f"off by more than {args.check:.0%}: world sizes "
              f"{', '.join(str(r['world_size']) for r in off)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
