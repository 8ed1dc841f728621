"""Checkpoint save/load throughput per rank (fullshard.checkpoint).

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_io.py [--world-size 2] [--repeats 3]

Saves a GPT (W1's shape: d=512, 8 layers, vocab 8192) with its AdamW state, then loads
it into fresh sharded model and optimizer, and reports MB/s per rank: this rank's share
of the checkpoint's bytes over the median wall time. Saving includes hashing every file
and the atomic commit; loading includes verifying every checksum.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from fullshard import checkpoint as ckpt
from fullshard import fully_shard
from fullshard.testing import run_distributed
from fullshard.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8)


def _sharded():
    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, CFG.vocab_size, (1, 16))
    lm_loss(model(x), x).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def worker(root: str, repeats: int) -> dict:
    model, opt = _sharded()
    fresh, fresh_opt = _sharded()
    saves, loads = [], []
    for i in range(repeats):
        path = os.path.join(root, f"step_{i}")
        dist.barrier()
        t = time.perf_counter()
        ckpt.save(path, model, opt, extra={"step": i})
        saves.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        ckpt.load(path, fresh, fresh_opt)
        loads.append(time.perf_counter() - t)
    size = sum(f["bytes"] for f in ckpt.read_manifest(path)["files"].values())
    return {"bytes": size, "save_s": statistics.median(saves), "load_s": statistics.median(loads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fullshard-ckpt-bench-") as root:
        res = run_distributed(worker, args.world_size, root, args.repeats, timeout=3600)[0]
    per_rank_mb = res["bytes"] / args.world_size / 1e6
    print(f"command: {' '.join(sys.argv)}")
    print(f"checkpoint {res['bytes'] / 1e6:.0f} MB (model + AdamW state), world size "
          f"{args.world_size}, {per_rank_mb:.0f} MB per rank\n")
    print("| operation | median s | MB/s per rank |\n|---|---:|---:|")
    print(f"| save (write, hash, commit) | {res['save_s']:.2f} | {per_rank_mb / res['save_s']:.0f} |")
    print(f"| load (verify, read, reshard) | {res['load_s']:.2f} | "
          f"{per_rank_mb / res['load_s']:.0f} |")


if __name__ == "__main__":
    main()
