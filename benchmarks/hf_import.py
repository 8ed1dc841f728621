"""Importing a Hugging Face model into a sharded model: time and host memory per rank.

    OMP_NUM_THREADS=1 python benchmarks/hf_import.py [--world-size 2] [--repeats 3] [--cold]
        [--layers 8] [--hidden 1024] [--dtype fp32|bf16]

Saves a Llama built from a config (no download; bf16, several safetensors files of at
most 100 MB) and times, alternating, in rounds whose order rotates:

- ``read once``: one process reading every file of the folder into memory allocated for
  it (each byte from the files into memory once): what "the disk's speed" is measured
  against;
- ``load_hf``: every rank builds the model with its parameters on the meta device (in
  ``--dtype``: fp32, as the trainer shards it, cast from the files' bf16; or bf16),
  shards it (its decoder layers, then the root) and reads its own shards
  (``fullshard.checkpoint.load_hf``); the time is the slowest rank's, building included,
  and ``load_hf`` alone;
- ``rank 0 + broadcast``: what the trainer did before: rank 0 ``from_pretrained``, the
  others on the meta device, then rank 0's state dict broadcast into the shards.

Host memory per rank, in one import of each kind in fresh processes after the timed
rounds (the sampling would slow the timed ones; a process that imported before reuses
the memory it freed): a thread samples the process's anonymous resident
memory (``RssAnon``: the mapped files' pages are the page cache's, not the process's)
every millisecond; the figure is the peak during the import over the level before it,
beside what the rank must hold (its shards) and the largest tensor of the model. Beside
it, the rise of the whole resident set (``VmHWM`` after the import over ``VmRSS``
before it, the high-water mark reset first): pages of files mapped into the process
count there, as they do against a job's memory limit.
Both sides start from the same state, set untimed before each of them:

- the page cache: by default rank 0 reads every file once through a small buffer (all
  of the files in the page cache: warm); with ``--cold`` it drops their pages
  (``posix_fadvise(POSIX_FADV_DONTNEED)``);
- the process's memory: the ranks run with ``MALLOC_MMAP_THRESHOLD_=131072``, so every
  allocation of a tensor's size gets fresh pages from the kernel and gives them back
  when freed, as in a process importing once. Without it glibc raises its threshold as
  the process frees memory and keeps what it freed, and "read once" took 0.025 s into
  memory a previous side had already touched or 0.17 s into fresh pages (the baseline's
  bimodal figures: 0.03 or 0.15-0.17 s), whatever the page cache held.

Each side's median is printed with its spread (fastest-slowest), and the median of the
rounds' ratios (each round's import over the same round's baseline). One untimed import
first pays for what a process does once (imports; transformers builds its table of every
architecture's conversions, about 0.4 s here, at the first load as ``from_pretrained``
does).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from fullshard.checkpoint import load_hf, parameters_on_meta
from fullshard.memory.process import (AnonymousPeak, current_rss_bytes, peak_rss_bytes,
                                      reset_peak_rss)
from fullshard.testing import run_distributed
from fullshard.wrap import auto_wrap

from checkpoint_io import evict_from_page_cache  # benchmarks/, beside this file


def _config(layers: int, hidden: int):
    import transformers
    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256, max_position_embeddings=2048)


def _save(folder: str, layers: int, hidden: int) -> None:
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(layers, hidden)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="100MB")


def _warm(folder: str) -> None:
    """Bring every file of the folder into the page cache, through one small buffer (no
    memory the size of the files is allocated or touched)."""
    buffer = bytearray(4 << 20)
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def _set_page_cache(folder: str, cold: bool) -> None:
    """The files' pages dropped from the page cache (``cold``), or all of them in it."""
    if cold:
        evict_from_page_cache(folder)
    else:
        _warm(folder)


def _read_once(folder: str) -> None:
    """Every file's bytes into memory allocated for them, once."""
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            data = bytearray(os.path.getsize(path))
            with open(path, "rb", buffering=0) as f:
                f.readinto(data)


class _Unmeasured(contextlib.nullcontext):
    """In place of AnonymousPeak in the timed rounds."""

    rise = 0

    def __enter__(self):
        return self


def _streamed(folder: str, dtype: torch.dtype, measure: bool = False) -> dict:
    import transformers
    built = time.perf_counter()
    config = transformers.AutoConfig.from_pretrained(folder)
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    auto_wrap(model)
    marked = measure and reset_peak_rss()
    resident = current_rss_bytes()
    started = time.perf_counter()
    with AnonymousPeak() if measure else _Unmeasured() as memory:
        load_hf(model, folder)
    loaded = time.perf_counter()
    rss_rise = peak_rss_bytes() - resident if marked else float("nan")
    shards = sum(p.to_local().numel() * dtype.itemsize for p in model.parameters())
    largest = max(p.numel() * dtype.itemsize for p in model.parameters())
    return {"load_hf_s": loaded - started, "build_s": started - built, "anon_rise": memory.rise,
            "rss_rise": rss_rise, "shards": shards, "largest": largest}


def _broadcast(folder: str, measure: bool = False) -> dict:
    from fullshard.train.model import load_hf_model, receive_initial_weights
    rank = dist.get_rank()
    with AnonymousPeak() if measure else _Unmeasured() as memory:
        model = load_hf_model(folder, on_meta=rank != 0)
        state = model.state_dict() if rank == 0 else {}
        auto_wrap(model)
        receive_initial_weights(model, state, torch.device("cpu"))
        del state
    return {"anon_rise": memory.rise}


def worker(folder: str, repeats: int, cold: bool, dtype: torch.dtype) -> dict:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rank = dist.get_rank()
    ops = ["read once", "load_hf", "rank 0 + broadcast"]
    times = {op: [] for op in ops}
    extra = {"load_hf alone": []}
    shards = largest = 0
    _streamed(folder, dtype)  # once untimed: imports, and transformers' table of conversions
    for i in range(repeats):
        for op in ops[i % 3:] + ops[:i % 3]:
            if rank == 0:  # the same page-cache state before every side, untimed
                _set_page_cache(folder, cold)
            dist.barrier()
            t = time.perf_counter()
            if op == "read once":
                if rank == 0:
                    _read_once(folder)
            elif op == "load_hf":
                out = _streamed(folder, dtype)
                extra["load_hf alone"].append(out["load_hf_s"])
                shards, largest = out["shards"], out["largest"]
            else:
                _broadcast(folder)
            dist.barrier()
            times[op].append(time.perf_counter() - t)
    return {"times": times, "extra": extra, "shards": shards, "largest": largest}


def memory_worker(folder: str, cold: bool, dtype: torch.dtype, measured: str) -> dict:
    """One import, the first thing this process does after its imports (a process that
    imported before would reuse the memory freed by then), with RssAnon sampled."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if dist.get_rank() == 0:
        _set_page_cache(folder, cold)
    dist.barrier()
    return _streamed(folder, dtype, True) if measured == "load_hf" else \
        _broadcast(folder, True)


def _load(averages: tuple[float, ...]) -> str:
    return "/".join(f"{x:.1f}" for x in averages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="the sharded parameters' dtype (the files are bf16)")
    parser.add_argument("--cold", action="store_true",
                        help="drop the folder from the page cache before every import")
    args = parser.parse_args()
    load_before = os.getloadavg()
    # fresh pages for every tensor-sized allocation in the ranks (read at their start)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    with tempfile.TemporaryDirectory(prefix="fullshard-hf-import-") as root:
        folder = os.path.join(root, "llama")
        _save(folder, args.layers, args.hidden)
        nbytes = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
                     if n.endswith(".safetensors"))
        files = sum(n.endswith(".safetensors") for n in os.listdir(folder))
        dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
        ranks = run_distributed(worker, args.world_size, folder, args.repeats, args.cold,
                                dtype, timeout=3600)
        memory = {measured: run_distributed(memory_worker, args.world_size, folder, args.cold,
                                            dtype, measured, timeout=3600)
                  for measured in ("load_hf", "broadcast")}
    med = statistics.median
    times = ranks[0]["times"]
    read = med(times["read once"])
    print(f"command: {' '.join(sys.argv)}")
    print(f"Llama, {args.layers} layers, hidden {args.hidden}: {nbytes / 1e6:.0f} MB of bf16 "
          f"in {files} safetensors files into {args.dtype} shards; world size "
          f"{args.world_size}; "
          f"{'cold' if args.cold else 'warm'} page cache, set before every side; medians of "
          f"{args.repeats}; MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}; "
          f"load average (1, 5, 15 min) {_load(load_before)} before, {_load(os.getloadavg())} after\n")
    print("| import | median s | fastest-slowest s | median / reading the files once | "
          "median of the rounds' ratios |\n|---|---:|---:|---:|---:|")

    def row(name: str, values: list[float]) -> None:
        ratios = [v / r for v, r in zip(values, times["read once"])]
        print(f"| {name} | {med(values):.3f} | {min(values):.3f}-{max(values):.3f} | "
              f"{med(values) / read:.2f} | {med(ratios):.2f} |")
    for op in ("read once", "load_hf", "rank 0 + broadcast"):
        row(op, times[op])
    # the slowest rank's, round by round
    alone = [max(vals) for vals in zip(*(r["extra"]["load_hf alone"] for r in ranks))]
    row("load_hf alone (slowest rank; building and sharding left out)", alone)
    print(f"\n| rank | its {args.dtype} shards MB | largest tensor MB | RssAnon rise, load_hf MB | "
          "/ (shards + largest) | RSS rise, load_hf MB | / shards | "
          "RssAnon rise, rank 0 + broadcast MB |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for rank, r in enumerate(ranks):
        rise = memory["load_hf"][rank]["anon_rise"]
        rss = memory["load_hf"][rank]["rss_rise"]
        print(f"| {rank} | {r['shards'] / 1e6:.0f} | {r['largest'] / 1e6:.0f} | "
              f"{rise / 1e6:.0f} | {rise / (r['shards'] + r['largest']):.2f} | "
              f"{rss / 1e6:.0f} | {rss / r['shards']:.2f} | "
              f"{memory['broadcast'][rank]['anon_rise'] / 1e6:.0f} |")


if __name__ == "__main__":
    main()
