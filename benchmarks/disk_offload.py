"""Optimizer states on disk (DiskOffloadPolicy) against CPU offload (CPUOffloadPolicy).

    OMP_NUM_THREADS=1 python benchmarks/disk_offload.py [--dir PATH] [--steps 8]
        [--memory-model w3] [--world-size 2] [--tiny]
        [--parts time,overlap,fraction,memory]

Five figures, each printed with the command's settings (``--parts`` picks them; time and
memory by default):

1. Step time, W1 (GPT d=512, 8 layers, vocab 8192, batch 8 x 128 per rank, AdamW): a
   CPU-offloaded and a disk-offloaded copy of the model train side by side in the same
   processes, steps interleaved (the machine's drift hits both alike); median step time
   and median optimizer.step() time of each, and their ratios.
2. Disk throughput: the bytes the disk-offloaded optimizer read and wrote over the time
   its I/O thread spent on them (MB/s), beside what ``dd`` with direct I/O writes and
   reads in the same directory (the disk's raw sequential speed).
3. Peak memory: each rank's peak RSS training ``--memory-model`` (default W3's shape:
   d=1024, 16 layers, vocab 32000) with CPU offload, with the states on disk, and with
   the states and the parameters on disk (``params=True``), each in fresh processes,
   against the bytes moved to disk (the AdamW states of the rank's shards less the three
   staging chunks; then also the fp32 parameter shards).
4. Overlap (``--parts overlap``): step time with the offloaded units stepped on
   ``OverlappedStep``'s host thread while the next forward runs, against the step inside
   ``optimizer.step()``, for CPU offload and for states on disk (blocks of ``--block``
   steps per model, each ending with a wait, so no model's host work runs in another's
   time).
5. Partial offload (``--parts fraction``): step time (the step inside
   ``optimizer.step()``) with the last ceil(f x 8) of W1's blocks offloaded, for f in 0,
   1/4, 1/2, 3/4 and 1 (everything, the root too), to the host (``cpu:f``) and with
   their states on disk (``disk:PATH:f``), each model built with the trainer's per-unit
   policies and stepped in turn; medians and the ratio to nothing offloaded.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from fullshard import CPUOffloadPolicy, DiskOffloadPolicy, OverlappedStep, fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.offload import disk_states_of
from fullshard.offload.fraction import offloaded_blocks
from fullshard.testing import run_distributed

W1 = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8)
W3 = GPTConfig(vocab_size=32000, seq_len=64, d_model=1024, n_layers=16, n_heads=16)
TINY = GPTConfig(vocab_size=256, seq_len=16, d_model=64, n_layers=2, n_heads=2)
MEMORY_MODELS = {"w1": (W1, 8), "w3": (W3, 2), "tiny": (TINY, 2)}
CHUNK = 1 << 20


def _sharded(cfg: GPTConfig, policy) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(cfg)
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _step(model, opt, x, y) -> tuple[float, float]:
    began = time.perf_counter()
    lm_loss(model(x), y).backward()
    stepping = time.perf_counter()
    opt.step()
    opt.zero_grad()
    done = time.perf_counter()
    return done - began, done - stepping


def _interleaved(directory: str, steps: int, cfg: GPTConfig) -> dict:
    cpu = _sharded(cfg, CPUOffloadPolicy())
    disk = _sharded(cfg, DiskOffloadPolicy(path=directory, chunk_numel=CHUNK))
    params = _sharded(cfg, DiskOffloadPolicy(path=directory, chunk_numel=CHUNK, params=True))
    g = torch.Generator().manual_seed(dist.get_rank())
    times = {"cpu": [], "disk": [], "params": []}
    models = [("cpu", cpu), ("disk", disk), ("params", params)]
    for i in range(steps + 2):
        x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=g)
        for name, (model, opt) in models[i % 3:] + models[:i % 3]:
            dist.barrier()
            t = _step(model, opt, x, x)
            if i >= 2:  # two warm-up steps: the first creates the states
                times[name].append(t)
    (states,) = disk_states_of(disk[1])
    states.files.drain()
    files = states.files
    return {"times": times, "read": files.bytes_read, "written": files.bytes_written,
            "io_seconds": files.io_seconds, "direct": files.direct,
            "staging": files.staging_bytes, "chunks": len(states.chunks)}


def _overlapped(directory: str, rounds: int, cfg: GPTConfig, block: int) -> dict:
    """Step time with each offloaded unit's step on OverlappedStep's host thread against
    the step inside ``optimizer.step()``, for CPU offload and for states on disk. Each
    model trains ``block`` steps in a row and then waits for its host steps, so the host
    work of one model never runs in another's time; the time per step is the block's."""
    kinds = {"cpu": lambda: CPUOffloadPolicy(),
             "disk": lambda: DiskOffloadPolicy(path=directory, chunk_numel=CHUNK)}
    runs = {}
    for kind, policy in kinds.items():
        for overlap in (False, True):
            model, opt = _sharded(cfg, policy())
            runs[(kind, overlap)] = (model, opt, OverlappedStep(opt) if overlap else opt)
    g = torch.Generator().manual_seed(dist.get_rank())
    times: dict = {key: [] for key in runs}
    order = list(runs)
    for r in range(rounds + 1):  # the first round warms up (it creates the states)
        for key in order[r % len(order):] + order[:r % len(order)]:
            model, opt, stepper = runs[key]
            dist.barrier()
            began = time.perf_counter()
            for _ in range(block):
                x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=g)
                lm_loss(model(x), x).backward()
                stepper.step()
                opt.zero_grad()
            if stepper is not opt:
                stepper.wait()
            if r:
                times[key].append((time.perf_counter() - began) / block)
    return {f"{kind}{'+overlap' if overlap else ''}": v for (kind, overlap), v in times.items()}


FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def _partially(cfg: GPTConfig, policy, fraction: float):
    """``cfg``'s GPT with the last ceil(fraction x blocks) blocks under ``policy`` (the
    root too at 1), as the trainer's unit_offload gives them."""
    torch.manual_seed(0)
    model = GPT(cfg)
    moved = {id(b) for b in offloaded_blocks(list(model.layers), fraction)}
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy if id(layer) in moved else None)
    fully_shard(model, offload_policy=policy if fraction == 1 else None)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def _fractions(directory: str, steps: int, cfg: GPTConfig) -> dict:
    models = {"none": _partially(cfg, None, 0.0)}
    for f in FRACTIONS:
        models[f"cpu:{f}"] = _partially(cfg, CPUOffloadPolicy(), f)
        models[f"disk:{f}"] = _partially(
            cfg, DiskOffloadPolicy(path=directory, chunk_numel=CHUNK), f)
    g = torch.Generator().manual_seed(dist.get_rank())
    times: dict = {k: [] for k in models}
    order = list(models)
    for i in range(steps + 2):
        x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=g)
        for name in order[i % len(order):] + order[:i % len(order)]:
            dist.barrier()
            t = _step(*models[name], x, x)
            if i >= 2:  # two warm-up steps: the first creates the states
                times[name].append(t[0])
    return times


def _peak_rss(kind: str, directory: str, model: str, steps: int) -> dict:
    cfg, batch = MEMORY_MODELS[model]
    policy = (CPUOffloadPolicy() if kind == "cpu" else
              DiskOffloadPolicy(path=directory, chunk_numel=CHUNK, params=kind == "params"))
    net, opt = _sharded(cfg, policy)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
        _step(net, opt, x, x)
    shard_numel = sum(p.to_local().numel() for p in net.parameters())
    staging = sum(s.files.staging_bytes for s in disk_states_of(opt))
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "states_bytes": 2 * 4 * shard_numel, "param_bytes": 4 * shard_numel,
            "staging": staging}


def _dd(directory: str, mib: int = 512) -> tuple[float, float]:
    """dd's direct-I/O write and read speed (MB/s) of a ``mib`` MiB file in ``directory``."""
    path = os.path.join(directory, "dd-probe.bin")
    speeds = []
    try:
        for args in (["if=/dev/zero", f"of={path}", "oflag=direct"],
                     [f"if={path}", "of=/dev/null", "iflag=direct"]):
            out = subprocess.run(["dd", *args, "bs=16M", f"count={mib // 16}"],
                                 capture_output=True, text=True, check=True).stderr
            began = re.search(r"copied, ([0-9.]+) s", out)
            speeds.append(mib * 2**20 / float(began.group(1)) / 1e6)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return speeds[0], speeds[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory for the state files (a local "
                    "disk; default: a new folder in the system's temp directory)")
    ap.add_argument("--steps", type=int, default=8, help="counted W1 steps per model")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--memory-model", choices=sorted(MEMORY_MODELS), default="w3")
    ap.add_argument("--memory-steps", type=int, default=3)
    ap.add_argument("--parts", default="time,memory", help="a comma-separated choice of "
                    "time (step time and disk throughput), overlap (the step on "
                    "OverlappedStep's host thread against inside optimizer.step), fraction "
                    "(the last blocks offloaded, to the host or with states on disk) and "
                    "memory (peak RSS)")
    ap.add_argument("--block", type=int, default=3, help="overlap: steps each model trains "
                    "in a row before the next model's turn")
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT for both parts (checks "
                    "the script; the figures mean nothing)")
    args = ap.parse_args()
    step_model = TINY if args.tiny else W1
    if args.tiny:
        args.memory_model = "tiny"
    directory = args.dir or tempfile.mkdtemp(prefix="fullshard-bench-")
    world = args.world_size
    print(f"torch {torch.__version__}, world size {world}, gloo, states in {directory}, "
          f"chunk {CHUNK} elements")

    if "time" in args.parts:
        _time_and_throughput(args, directory, world, step_model)
    if "overlap" in args.parts:
        _overlap(args, directory, world, step_model)
    if "fraction" in args.parts:
        _fraction(args, directory, world, step_model)
    if "memory" in args.parts:
        _memory(args, directory, world)
    if not args.dir:
        os.rmdir(directory)


def _time_and_throughput(args, directory: str, world: int, step_model: GPTConfig) -> None:
    out = run_distributed(_interleaved, world, directory, args.steps, step_model, timeout=1800)
    total = {k: [t[0] for t in v] for k, v in out[0]["times"].items()}
    stepping = {k: [t[1] for t in v] for k, v in out[0]["times"].items()}
    med = {k: statistics.median(v) * 1e3 for k, v in total.items()}
    opt_med = {k: statistics.median(v) * 1e3 for k, v in stepping.items()}
    print(f"\n{'tiny' if args.tiny else 'W1'} step time, {args.steps} interleaved steps per model (rank 0, median):")
    print(f"  CPU offload      step {med['cpu']:8.1f} ms   optimizer.step {opt_med['cpu']:7.1f} ms")
    print(f"  states on disk   step {med['disk']:8.1f} ms   optimizer.step {opt_med['disk']:7.1f} ms")
    print(f"  + params on disk step {med['params']:8.1f} ms   optimizer.step "
          f"{opt_med['params']:7.1f} ms")
    print(f"  disk / CPU       step {med['disk'] / med['cpu']:8.2f}      optimizer.step "
          f"{opt_med['disk'] / opt_med['cpu']:7.2f}")
    print(f"  + params / CPU   step {med['params'] / med['cpu']:8.2f}      optimizer.step "
          f"{opt_med['params'] / opt_med['cpu']:7.2f}")

    r = out[0]
    moved = r["read"] + r["written"]
    wr, rd = _dd(directory, 32 if args.tiny else 512)
    print(f"\ndisk: {r['chunks']} chunks per step, O_DIRECT {r['direct']}, staging "
          f"{r['staging'] / 2**20:.0f} MiB per rank")
    print(f"  fullshard I/O thread (rank 0): {moved / 1e6:,.0f} MB in {r['io_seconds']:.2f} s "
          f"= {moved / 1e6 / r['io_seconds']:,.0f} MB/s (read {r['read'] / 1e6:,.0f} MB, "
          f"written {r['written'] / 1e6:,.0f} MB; {world} ranks share the disk)")
    print(f"  dd direct I/O, one process: write {wr:,.0f} MB/s, read {rd:,.0f} MB/s")



def _overlap(args, directory: str, world: int, step_model: GPTConfig) -> None:
    out = run_distributed(_overlapped, world, directory, args.steps, step_model, args.block,
                          timeout=1800)
    med = {k: statistics.median(v) * 1e3 for k, v in out[0].items()}
    print(f"\n{'tiny' if args.tiny else 'W1'} step time with OverlappedStep, {args.steps} "
          f"interleaved rounds of {args.block} steps per model (rank 0, median per step):")
    for kind, what in (("cpu", "CPU offload"), ("disk", "states on disk")):
        print(f"  {what:15s} in optimizer.step {med[kind]:8.1f} ms   on the host thread "
              f"{med[kind + '+overlap']:8.1f} ms   ratio {med[kind + '+overlap'] / med[kind]:5.2f}")


def _fraction(args, directory: str, world: int, step_model: GPTConfig) -> None:
    out = run_distributed(_fractions, world, directory, args.steps, step_model, timeout=1800)
    med = {k: statistics.median(v) * 1e3 for k, v in out[0].items()}
    print(f"\n{'tiny' if args.tiny else 'W1'} step time, the last blocks offloaded, "
          f"{args.steps} interleaved steps per model (rank 0, median; ratio to none "
          f"{med['none']:.1f} ms):")
    print(f"  {'fraction':>8}  {'CPU offload':>18}  {'states on disk':>18}")
    for f in FRACTIONS:
        cpu, disk = med[f"cpu:{f}"], med[f"disk:{f}"]
        print(f"  {f:8.2f}  {cpu:9.1f} ms {cpu / med['none']:5.2f}x  "
              f"{disk:9.1f} ms {disk / med['none']:5.2f}x")


def _memory(args, directory: str, world: int) -> None:
    print(f"\npeak RSS per rank, {args.memory_model} ({args.memory_steps} steps, fresh "
          "processes each):")
    peaks = {}
    for kind in ("cpu", "disk", "params"):
        peaks[kind] = run_distributed(_peak_rss, world, kind, directory, args.memory_model,
                                      args.memory_steps, timeout=1800)
    for rank in range(world):
        cpu = peaks["cpu"][rank]
        for kind, what in (("disk", "states"), ("params", "states and parameters")):
            disk = peaks[kind][rank]
            drop = cpu["peak_rss"] - disk["peak_rss"]
            moved = cpu["states_bytes"] - disk["staging"] + (
                cpu["param_bytes"] if kind == "params" else 0)
            print(f"  rank {rank}: CPU offload {cpu['peak_rss'] / 2**20:,.0f} MiB, {what} on "
                  f"disk {disk['peak_rss'] / 2**20:,.0f} MiB: drop {drop / 2**20:,.0f} MiB; "
                  f"moved to disk less staging {moved / 2**20:,.0f} MiB; drop / moved "
                  f"{drop / moved:.3f}")


if __name__ == "__main__":
    sys.exit(main())
