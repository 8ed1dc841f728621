"""Quantized communication (int8 all-gather and reduce-scatter) against full precision.

    OMP_NUM_THREADS=1 python benchmarks/quantized_comm.py [--workloads W2,W1] [--steps 10]
        [--bf16] [--world-size 2] [--tiny]

For each workload, four copies of the same model train side by side in the same
processes (fullshard with no quantization, weights only, grads only, both), steps
interleaved so the machine's drift hits all alike. Printed per copy: the bytes this rank
sent per step in all-gathers and reduce-scatters (counted at torch.distributed), the
median step time, and both as ratios to the unquantized copy. Gloo on one machine is not
bandwidth-bound, so the time ratio shows the cost of quantizing, not the gain a slow link
would give; the bytes say what a link would carry.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_sent_bytes

WORKLOADS = {
    "W1": (GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8), 8),
    "W2": (GPTConfig(vocab_size=512, seq_len=32, d_model=64, n_layers=32, n_heads=4), 4),
    "tiny": (GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2), 2),
}
SETTINGS = {"none": (False, False), "weights": (True, False), "grads": (False, True),
            "weights,grads": (True, True)}


def _run(workload: str, steps: int, bf16: bool) -> dict:
    cfg, batch = WORKLOADS[workload]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
        if bf16 else MixedPrecisionPolicy()
    copies = {}
    for name, (weights, grads) in SETTINGS.items():
        torch.manual_seed(0)
        model = GPT(cfg)
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        model.set_quantized_communication(weights=weights, grads=grads)
        copies[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(dist.get_rank())
    times = {name: [] for name in copies}
    sent = {name: Counter() for name in copies}
    order = list(copies)
    for i in range(steps + 1):
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
        for name in order[i % len(order):] + order[:i % len(order)]:
            model, opt = copies[name]
            dist.barrier()
            began = time.perf_counter()
            with count_sent_bytes() as counts:
                lm_loss(model(x), x).backward()
                opt.step()
                opt.zero_grad()
            if i:  # the first step builds buffers
                times[name].append(time.perf_counter() - began)
                sent[name] = counts
    return {"times": times, "bytes": {k: dict(v) for k, v in sent.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="W2,W1")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 gathers and reductions")
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT (checks the script)")
    args = ap.parse_args()
    workloads = ["tiny"] if args.tiny else args.workloads.split(",")
    print(f"torch {torch.__version__}, world size {args.world_size}, gloo, "
          f"{'bf16' if args.bf16 else 'fp32'} gathers and reductions, AdamW, "
          f"{args.steps} interleaved steps per copy (rank 0, median)")
    for workload in workloads:
        out = run_distributed(_run, args.world_size, workload, args.steps, args.bf16,
                              timeout=3600)[0]
        base_t = statistics.median(out["times"]["none"])
        base_b = out["bytes"]["none"]
        print(f"\n| {workload} | all-gather MB/step | x | reduce-scatter MB/step | x | "
              "step ms | x |")
        print("|---|---|---|---|---|---|---|")
        for name in SETTINGS:
            t = statistics.median(out["times"][name])
            b = out["bytes"][name]
            print(f"| {name} | {b['all_gather'] / 1e6:.2f} | "
                  f"{b['all_gather'] / base_b['all_gather']:.3f} | "
                  f"{b['reduce_scatter'] / 1e6:.2f} | "
                  f"{b['reduce_scatter'] / base_b['reduce_scatter']:.3f} | "
                  f"{t * 1e3:.1f} | {t / base_t:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
