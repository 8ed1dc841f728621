"""Calibration from the machine at hand: the compute rate a training step achieves, the
memory bandwidth the optimizer sees, and a link fitted to a measured collective sweep.

``fullshard project --calibrate`` runs these (cli/project.py) and projects with the
result; on a CPU-only machine that is the only way to a projection of *this* machine.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ..core.comm import all_gather, reduce_scatter_sum
from ..gpt import GPT, GPTConfig, lm_loss
from .hardware import Device, Link, ProjectionError
from .shapes import shape_of

SWEEP_NUMELS = (2**14, 2**16, 2**18, 2**20, 2**22)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def median_step_seconds(model: torch.nn.Module, x: torch.Tensor, steps: int, warmup: int,
                        before_each=None) -> float:
    """Median seconds of an AdamW language-model training step on tokens ``x`` (inputs
    and shifted targets), after ``warmup`` steps; ``before_each`` runs untimed first (a
    barrier, when ranks step together)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(warmup + steps):
        if before_each is not None:
            before_each()
        begin = time.perf_counter()
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    return _median(times)


def achieved_flops(cfg: GPTConfig, batch: int, seq: int, steps: int = 5,
                   warmup: int = 2) -> float:
    """FLOP/s of a plain (unsharded) training step of ``cfg`` in this process: model FLOPs
    (shapes.py's convention) over the median step time."""
    torch.manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    seconds = median_step_seconds(GPT(cfg), x, steps, warmup)
    return shape_of(cfg).model_flops_per_token(seq) * batch * seq / seconds


def memory_bandwidth(numel: int = 2**24, repeats: int = 5) -> float:
    """Bytes/s of a large copy (read + write), the optimizer step's bound."""
    src, dst = torch.ones(numel), torch.empty(numel)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - begin)
    return 2 * 4 * numel / _median(times)


def sweep_collectives(numels: tuple[int, ...] = SWEEP_NUMELS, repeats: int = 5,
                      ) -> list[tuple[str, int, int, float]]:
    """Run on every rank of an initialized group: (kind, ranks, full bytes, seconds) of
    fullshard's own all-gather and reduce-scatter at each size, medians over repeats."""
    world = dist.get_world_size()
    group = dist.group.WORLD
    samples = []
    for numel in numels:
        numel -= numel % world
        full, shard = torch.ones(numel), torch.ones(numel // world)
        for kind in ("all_gather", "reduce_scatter"):
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                begin = time.perf_counter()
                if kind == "all_gather":
                    all_gather(full, shard, group).wait()
                else:
                    reduce_scatter_sum(shard, full, group).wait()
                times.append(time.perf_counter() - begin)
            samples.append((kind, world, numel * 4, _median(times[1:])))
    return samples


def fit_link(samples: list[tuple[str, int, int, float]]) -> Link:
    """Least-squares latency and bandwidth of comm.py's ring model to measured samples:
    t = (n - 1)·alpha + (n - 1)/n · bytes · beta."""
    rows = [((n - 1), (n - 1) / n * nbytes, t) for _, n, nbytes, t in samples if n > 1]
    if len(rows) < 2:
        raise ProjectionError("a link needs samples at two sizes or more over 2+ ranks")
    saa = sum(a * a for a, _, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sat = sum(a * t for a, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = saa * sbb - sab * sab
    alpha = (sat * sbb - sbt * sab) / det
    beta = (saa * sbt - sab * sat) / det
    if beta <= 0:
        raise ProjectionError("the collective sweep did not grow with size; rerun it on a "
                              "quieter machine")
    return Link(bandwidth=1 / beta, latency=max(alpha, 0.0))


def calibrated_cpu(flops: float, link: Link, bandwidth: float,
                   cores: int | None = None) -> Device:
    """This machine as a projection device: the measured compute rate at efficiency 1,
    one node (intra and inter the same loopback), no overlap (Note in hardware.py)."""
    cores = cores or len(os.sched_getaffinity(0))
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Device("cpu (calibrated)", flops, mem, bandwidth, efficiency=1.0, overlaps_comm=False,
                  cores=cores, intra=link, inter=link,
                  source="measured on this machine by fullshard project --calibrate")
