"""fullshard vs PyTorch FSDP2 (and DDP, and the single-process floor), side by side.

    OMP_NUM_THREADS=1 python benchmarks/compare_fsdp2.py            # every row of the table
    OMP_NUM_THREADS=1 python benchmarks/compare_fsdp2.py --workloads W2 --world-size 4
    OMP_NUM_THREADS=1 python benchmarks/compare_fsdp2.py --workloads W2,W1 --impls fullshard-fsdp1,fsdp1

``fullshard-fsdp1`` and ``fsdp1`` are the FSDP1 wrapper APIs (fullshard's
``FullyShardedDataParallel`` and torch's) with one unit per block and torch's defaults.
``fullshard-unguarded`` is fullshard with the divergence guard taken off after its first
step (Note [ranks agree on every collective]): ``--impls fullshard,fullshard-unguarded``
measures what the guard costs.

Every implementation trains its own copy of the same model (same initial weights,
same batches) inside one set of ranks. Steps are interleaved (A B C D A B C D ...)
so machine noise hits all of them alike; each step time is the slowest rank's, and
the figure is the median over the timed steps. Ratios are the result: absolute
times on shared machines are noise.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fullshard.testing import run_distributed
from fullshard.gpt import GPT, GPTConfig, lm_loss
from memory import memory_report


@dataclass(frozen=True)
class Workload:
    name: str
    cfg: GPTConfig
    batch: int
    seq: int
    warmup: int
    steps: int


WORKLOADS = {
    "W1": Workload("W1 compute-bound", GPTConfig(vocab_size=8192, seq_len=128, d_model=512,
                                                 n_layers=8, n_heads=8), 8, 128, 2, 5),
    "W2": Workload("W2 overhead-bound", GPTConfig(vocab_size=512, seq_len=32, d_model=64,
                                                  n_layers=32, n_heads=4), 4, 32, 3, 15),
}
IMPLS = ("fullshard", "fsdp2", "ddp", "single")
W3 = GPTConfig(vocab_size=32000, seq_len=64, d_model=1024, n_layers=16, n_heads=16)


def build(impl: str, base: GPT, reshard_after_forward: bool,
          bucket_numel: int | None = None, bf16: bool = False) -> torch.nn.Module:
    model = copy.deepcopy(base)
    if impl in ("fullshard", "fsdp2", "fullshard-unguarded"):
        if impl != "fsdp2":
            from fullshard import MixedPrecisionPolicy, fully_shard
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 else MixedPrecisionPolicy()
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        # the root with torch's default (None): kept from forward to backward by both
        # implementations, as an explicit True would make both free and re-gather it
        fully_shard(model, mp_policy=policy)
        if impl != "fsdp2" and bucket_numel is not None:
            model.set_bucket_numel(bucket_numel)
    elif impl in ("fullshard-fsdp1", "fsdp1"):
        from fullshard.gpt import Block
        if impl == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
            from torch.distributed.fsdp import MixedPrecision
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        else:
            from fullshard import FSDP, MixedPrecision, ShardingStrategy
            from fullshard.wrap import ModuleWrapPolicy
        strategy = ShardingStrategy.FULL_SHARD if reshard_after_forward \
            else ShardingStrategy.SHARD_GRAD_OP
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 else None
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                     sharding_strategy=strategy, mixed_precision=mixed, device_id=device)
    elif impl == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


PAGE_FAULTS = "minor page faults (a count)"


class PhaseTimer:
    """Wall time per phase of a step, plus time spent inside ``Work.wait()``."""

    def __init__(self):
        self.wait_s = 0.0
        real_wait = dist.Work.wait
        timer = self

        def timed_wait(work, *args, **kwargs):
            start = time.perf_counter()
            try:
                return real_wait(work, *args, **kwargs)
            finally:
                timer.wait_s += time.perf_counter() - start
        dist.Work.wait = timed_wait

    def step(self, model, opt, x, y) -> tuple[torch.Tensor, dict[str, float]]:
        self.wait_s = 0.0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = lm_loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        phases = {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
                  "in Work.wait": self.wait_s,
                  # fresh pages the step touched (the allocator handing back freed blocks and
                  # mapping them again): a cost of the CPU that no timer above names
                  PAGE_FAULTS: resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}
        return loss.detach(), phases


def strip_guard(model: torch.nn.Module) -> None:
    """Take the divergence guard off a fullshard root after lazy init (measuring only)."""
    from fullshard.core.state import unit_of
    root = unit_of(model).root
    root.guard = root.patience = None
    for group in root.members:
        group.guard = None


def bench_worker(wl: Workload, impls: tuple[str, ...], reshard_after_forward: bool,
                 bucket_numel: int | None = None, bf16: bool = False) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = GPT(wl.cfg)
    models = {i: build(i, base, reshard_after_forward, bucket_numel, bf16) for i in impls}
    opts = {i: torch.optim.AdamW(m.parameters(), lr=1e-4) for i, m in models.items()}
    times: dict[str, list[float]] = {i: [] for i in impls}
    phases: dict[str, list[dict]] = {i: [] for i in impls}
    losses: dict[str, list[float]] = {i: [] for i in impls}
    timer = PhaseTimer()
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(wl.warmup + wl.steps):
        x = torch.randint(0, wl.cfg.vocab_size, (wl.batch, wl.seq), generator=gen)
        y = torch.roll(x, -1, 1)
        for impl in impls:
            dist.barrier()
            start = time.perf_counter()
            loss, step_phases = timer.step(models[impl], opts[impl], x, y)
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            losses[impl].append(loss.float().item())
            if step == 0 and impl == "fullshard-unguarded":
                strip_guard(models[impl])
            if step >= wl.warmup:
                times[impl].append(elapsed.item())
                phases[impl].append(step_phases)
    return {"median_s": {i: statistics.median(t) for i, t in times.items()},
            "phases_s": {i: {k: statistics.median(p[k] for p in ps) for k in ps[0]}
                         for i, ps in phases.items()},
            "losses": losses}


def report(wl: Workload, world: int, raf: bool, res: dict, bf16: bool = False) -> str:
    med = res["median_s"]
    bf16_note = ", bf16 mixed precision (fp32 reduce)" if bf16 else ""
    lines = [f"### {wl.name}: GPT d={wl.cfg.d_model} L={wl.cfg.n_layers} vocab="
             f"{wl.cfg.vocab_size}, batch {wl.batch}x{wl.seq}/rank, world {world}, "
             f"reshard_after_forward={raf}{bf16_note}", "",
             "| impl | median step (ms) | fullshard / impl |", "|---|---:|---:|"]
    for impl, t in med.items():
        ratio = med["fullshard"] / t if "fullshard" in med else float("nan")
        lines.append(f"| {impl} | {t * 1e3:.1f} | {ratio:.2f} |")
    lines += ["", "| phase (rank 0, median ms) | " + " | ".join(res["phases_s"]) + " |",
              "|---|" + "---:|" * len(res["phases_s"])]
    for phase in next(iter(res["phases_s"].values())):
        lines.append(f"| {phase} | " + " | ".join(
            f"{p[phase]:.0f}" if phase == PAGE_FAULTS else f"{p[phase] * 1e3:.1f}"
            for p in res["phases_s"].values()) + " |")
    if "fullshard-unguarded" in med and "fullshard" in med:
        lines.append(f"\ndivergence guard: fullshard / fullshard-unguarded = "
                     f"{med['fullshard'] / med['fullshard-unguarded']:.4f}")
    if "fsdp1" in med and "fullshard-fsdp1" in med:
        lines.append(f"\nFSDP1 API: fullshard-fsdp1 / fsdp1 = "
                     f"{med['fullshard-fsdp1'] / med['fsdp1']:.2f}")
    if "fsdp2" in res["losses"] and "fullshard" in res["losses"]:
        diff = max(abs(a - b) for a, b in zip(res["losses"]["fullshard"], res["losses"]["fsdp2"]))
        lines.append(f"\nmax |loss(fullshard) - loss(fsdp2)| over all steps: {diff:.2e}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W2,W1,W3",
                        help="W1/W2: step time, interleaved; W3: peak memory per rank")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: per workload)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--zero2", action="store_true", help="reshard_after_forward=False")
    parser.add_argument("--bf16", action="store_true",
                        help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for "
                             "fullshard and FSDP2 (use --impls fullshard,fsdp2)")
    parser.add_argument("--bucket-numel", type=int, default=None,
                        help="fullshard's set_bucket_numel (default: the library default)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    impls = tuple(args.impls.split(","))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS="
          f"{os.environ['OMP_NUM_THREADS']}, command: {' '.join(sys.argv)}\n")
    for key in args.workloads.split(","):
        if key == "W3":
            print(memory_report(W3, args.world_size, batch=2, seq=64, steps=3), "\n", flush=True)
            continue
        wl = WORKLOADS[key]
        if args.steps:
            wl = Workload(wl.name, wl.cfg, wl.batch, wl.seq, wl.warmup, args.steps)
        res = run_distributed(bench_worker, args.world_size, wl, impls, not args.zero2,
                              args.bucket_numel, args.bf16, timeout=3600)[0]
        print(report(wl, args.world_size, not args.zero2, res, args.bf16), "\n", flush=True)


if __name__ == "__main__":
    main()
