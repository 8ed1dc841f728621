"""Checkpoint save/load throughput per rank (fullshard.checkpoint).

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_io.py [--world-size 2] [--repeats 3]

Saves a GPT (W1's shape: d=512, 8 layers, vocab 8192) with its AdamW state, then loads
it into fresh sharded model and optimizer, and reports MB/s per rank: this rank's share
of the checkpoint's bytes over the median wall time. Saving includes hashing every file
and the atomic commit; loading includes verifying every checksum. The same state is
saved and loaded with torch's DCP (``dcp.save`` / ``dcp.load`` of torch's
``get_state_dict``, no checksums), alternating with fullshard's, and the ratio printed.
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


def _timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _dcp_save(path: str, model, opt) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _dcp_load(path: str, model, opt) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def worker(root: str, repeats: int) -> dict:
    model, opt = _sharded()
    fresh, fresh_opt = _sharded()
    times: dict[str, list[float]] = {"save_s": [], "load_s": [], "dcp_save_s": [],
                                     "dcp_load_s": []}
    for i in range(repeats):  # interleaved, so drift on a shared disk hits both alike
        path, dcp_path = os.path.join(root, f"step_{i}"), os.path.join(root, f"dcp_{i}")
        times["save_s"].append(_timed(lambda: ckpt.save(path, model, opt, extra={"step": i})))
        times["dcp_save_s"].append(_timed(lambda: _dcp_save(dcp_path, model, opt)))
        times["load_s"].append(_timed(lambda: ckpt.load(path, fresh, fresh_opt)))
        times["dcp_load_s"].append(_timed(lambda: _dcp_load(dcp_path, fresh, fresh_opt)))
    size = sum(f["bytes"] for f in ckpt.read_manifest(path)["files"].values())
    return {"bytes": size, **{k: statistics.median(v) for k, v in times.items()}}


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
    print("| operation | fullshard median s | MB/s per rank | torch DCP median s | "
          "fullshard / DCP |\n|---|---:|---:|---:|---:|")
    for op, what in (("save", "write, hash, commit"), ("load", "verify, read, reshard")):
        mine, theirs = res[f"{op}_s"], res[f"dcp_{op}_s"]
        print(f"| {op} ({what}) | {mine:.2f} | {per_rank_mb / mine:.0f} | {theirs:.2f} | "
              f"{mine / theirs:.2f} |")


if __name__ == "__main__":
    main()
