"""Checkpoint save/load throughput per rank (fullshard.checkpoint).

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_io.py [--world-size 2] [--repeats 3] [--options]
        [--cold] [--backend nccl]

Saves a GPT (W1's shape: d=512, 8 layers, vocab 8192) with its AdamW state, then loads
it into fresh sharded model and optimizer, and reports MB/s per rank: this rank's share
of the checkpoint's bytes over the median wall time. Saving includes hashing every file
and the atomic commit; loading includes verifying every checksum. The same state is
saved and loaded with torch's DCP (``dcp.save`` / ``dcp.load`` of torch's
``get_state_dict``, no checksums), alternating with fullshard's. Three ratios are
printed: of the median wall times; the median over pairs of each run's wall time over
the DCP run right after it (steadier when other work shares the machine: both runs of
a pair see the same load); and the same for rank 0's CPU seconds (what the hashing
costs, which other work disturbs least). ``--options`` also times the checksum options
fullshard chose from: sha256 or XXH3, each hashed while written or read back after the
write. ``--cold`` drops both checkpoints' files from the page cache before every load
(``posix_fadvise(DONTNEED)``, no privileges needed), so that loads read the disk.
``--backend nccl`` puts each rank's model and optimizer state on its own GPU (at world
size 1 the shard group still gathers through NCCL, as FSDP2's does): saves copy the
shards to the host, loads copy them back.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from fullshard import checkpoint as ckpt
from fullshard.checkpoint import checksums, hashing_writer
from fullshard import fully_shard
from fullshard.testing import collectives_at_one_rank, rank_device, run_distributed
from fullshard.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8)


def _sharded():
    torch.manual_seed(0)
    device = rank_device()
    model = GPT(CFG).to(device)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, CFG.vocab_size, (1, 16), device=device)
    lm_loss(model(x), x).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _timed(fn) -> tuple[float, float]:
    """Wall seconds (the slowest rank's, between barriers) and this rank's CPU seconds.
    Writes still in flight from the previous operation (deleting the last checkpoints,
    for one) are flushed first, so that no operation pays for another's."""
    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()
    t, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - t, cpu


def evict_from_page_cache(*directories: str) -> None:
    """Drop the page cache's copies of every file in ``directories`` (written back
    first), so that the next read comes from the disk: ``--cold``."""
    os.sync()
    for directory in directories:
        for name in os.listdir(directory):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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


# How fullshard checksums a checkpoint, and the options it was chosen from (``--options``):
# name -> (algorithm, hashed while written; else every file is read back after the write,
# split across ranks, as fullshard did before).
SHIPPED = "xxh3, while writing"
OPTIONS = {
    "sha256, read back": (checksums.SHA256, False),
    "sha256, while writing": (checksums.SHA256, True),
    "xxh3, read back": (checksums.XXH3, False),
    SHIPPED: (checksums.XXH3, True),
}


def _use(option: str) -> None:
    """Make this process's saves hash as ``option`` says (the benchmark's own ranks only)."""
    algorithm, while_writing = OPTIONS[option]
    checksums.preferred = lambda: algorithm
    hashing_writer.HashingWriter.entries = _ENTRIES if while_writing else (lambda self: {})


_ENTRIES = hashing_writer.HashingWriter.entries


def worker(root: str, repeats: int, options: list[str], cold: bool = False) -> dict:
    collectives_at_one_rank()
    # fullshard and DCP each save from, and load into, models of their own (built alike):
    # what one implementation's load leaves in a model and its optimizer (DTensor state
    # or plain, as each state-dict path sets it) must not change what the other one costs.
    model, opt = _sharded()
    dcp_model, dcp_opt = _sharded()
    fresh, fresh_opt = _sharded()
    dcp_fresh, dcp_fresh_opt = _sharded()
    times = {o: {k: [] for k in ("save", "load", "dcp_save", "dcp_load")} for o in options}
    # Interleaved, so drift on a shared machine hits fullshard and DCP alike. Where an
    # operation falls in the sequence moves its time (by 1.5x here), so every option takes
    # every place in turn, and within a pair fullshard and DCP take turns at going first,
    # once over every rotation of the options.
    n = len(options)
    for i in range(repeats):
        for j in range(n):
            option = options[(i + j) % n]
            _use(option)
            t = times[option]
            path, dcp_path = os.path.join(root, "fullshard"), os.path.join(root, "dcp")
            ops = [("save", lambda: ckpt.save(path, model, opt, extra={"step": i})),
                   ("dcp_save", lambda: _dcp_save(dcp_path, dcp_model, dcp_opt)),
                   ("load", lambda: ckpt.load(path, fresh, fresh_opt)),
                   ("dcp_load", lambda: _dcp_load(dcp_path, dcp_fresh, dcp_fresh_opt))]
            if (i // n) % 2:
                ops = [ops[1], ops[0], ops[3], ops[2]]
            for name, fn in ops:
                if cold and name.endswith("load") and dist.get_rank() == 0:
                    evict_from_page_cache(path, dcp_path)
                t[name].append(_timed(fn))
            files = ckpt.read_manifest(path)["files"].values()
            assert {checksums.algorithm_of(e) for e in files} == {OPTIONS[option][0]}, option
            size = sum(f["bytes"] for f in files)
            dist.barrier()
            if dist.get_rank() == 0:  # one checkpoint of each on disk at a time
                shutil.rmtree(path)
                shutil.rmtree(dcp_path)
            dist.barrier()
    return {"bytes": size, **{o: _summary(t) for o, t in times.items()}}


def _summary(times: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Per operation: median wall and CPU seconds, and the median over pairs of each run's
    ratio to the DCP run right after it."""
    out = {}
    med = statistics.median
    for op in ("save", "load"):
        mine, theirs = times[op], times[f"dcp_{op}"]
        out[op] = med(w for w, _ in mine)
        out[f"dcp_{op}"] = med(w for w, _ in theirs)
        out[f"{op}_paired"] = med(a[0] / b[0] for a, b in zip(mine, theirs))
        out[f"{op}_cpu_paired"] = med(a[1] / b[1] for a, b in zip(mine, theirs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--options", action="store_true",
                        help="also time the checksum options fullshard chose from")
    parser.add_argument("--cold", action="store_true",
                        help="drop both checkpoints from the page cache before each load, "
                        "so that loads read the disk")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                        help="nccl: each rank's state on its own GPU")
    args = parser.parse_args()
    options = list(OPTIONS) if args.options else [SHIPPED]
    with tempfile.TemporaryDirectory(prefix="fullshard-ckpt-bench-") as root:
        res = run_distributed(worker, args.world_size, root, args.repeats, options,
                              args.cold, timeout=3600, backend=args.backend)[0]
    per_rank_mb = res["bytes"] / args.world_size / 1e6
    print(f"command: {' '.join(sys.argv)}")
    print(f"checkpoint {res['bytes'] / 1e6:.0f} MB (model + AdamW state), world size "
          f"{args.world_size}, {per_rank_mb:.0f} MB per rank, backend {args.backend}"
          + (", loads from a cold page cache\n" if args.cold else "\n"))
    print("| checksums | operation | fullshard median s | MB/s per rank | torch DCP median s | "
          "/ DCP, medians | / DCP, median of pairs | / DCP, rank 0 CPU s, median of pairs |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for option in options:
        r = res[option]
        for op, what in (("save", "write, hash, commit"), ("load", "verify, read, reshard")):
            mine, theirs = r[op], r[f"dcp_{op}"]
            print(f"| {option} | {op} ({what}) | {mine:.2f} | {per_rank_mb / mine:.0f} | "
                  f"{theirs:.2f} | {mine / theirs:.2f} | {r[f'{op}_paired']:.2f} | "
                  f"{r[f'{op}_cpu_paired']:.2f} |")


if __name__ == "__main__":
    main()
