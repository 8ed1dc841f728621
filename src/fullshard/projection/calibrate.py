"""Calibration from the machine at hand: the compute rate a training step achieves, the
memory bandwidth the optimizer sees, and a link fitted to a measured collective sweep.

``fullshard project --calibrate`` runs these (cli/project.py) and projects with the
result; on a CPU-only machine that is the only way to a projection of *this* machine.

Note [calibrating on one GPU]
On a GPU the fitted compute model is an average over published runs; the user's own model
on the user's own GPU is the better judge of its compute. ``calibrate_device`` times a
stand-in of the model's shape (projection/standin.py) on this GPU at the micro-batch and
sequence asked for, with one block and with two: their difference is one block's forward
and backward, the rest is the embedding, the head and the loss. Two depths, because a
model that needs the cluster does not fit one GPU whole, and because one depth cannot
tell a block's time from the rest's. The model's whole micro-batch then takes ``layers x
block + rest``, and the executed FLOPs the projection counts for it over that time, as a
fraction of the named device's datasheet peak, become the device's ``efficiency``: the
projection at one rank reproduces the measured compute, and only extrapolates
communication, memory and the optimizer (from the datasheet's links and bandwidth) to
the cluster. Parameters are cast to the compute dtype, as FSDP's mixed precision does;
the optimizer is left out (the projection prices it apart).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ..core.comm import all_gather, reduce_scatter_sum
from ..gpt import GPT, GPTConfig, lm_loss
from .hardware import Device, Link, ProjectionError
from .shapes import ModelShape, shape_of
from .standin import StandIn

SWEEP_NUMELS = (2**14, 2**16, 2**18, 2**20, 2**22)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _step_times(step, steps: int, warmup: int, before_each=None) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step()`` after ``warmup`` untimed ones;
    ``before_each`` runs untimed before every call."""
    times = []
    for i in range(warmup + steps):
        if before_each is not None:
            before_each()
        begin = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    return times


def median_step_seconds(model: torch.nn.Module, x: torch.Tensor, steps: int, warmup: int,
                        before_each=None) -> float:
    """Median seconds of an AdamW language-model training step on tokens ``x`` (inputs
    and shifted targets), after ``warmup`` steps; ``before_each`` runs untimed first (a
    barrier, when ranks step together)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _median(_step_times(step, steps, warmup, before_each))


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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stand_in_seconds(shape: ModelShape, layers: int, batch: int, seq: int,
                     device: torch.device, dtype: torch.dtype, steps: int = 5,
                     warmup: int = 2) -> float:
    """Seconds of one forward and backward of ``StandIn(shape, layers)`` over ``batch``
    sequences of ``seq`` tokens on ``device``, its parameters in ``dtype``: the fastest of
    ``steps`` after ``warmup`` (other work on the machine only ever slows a step, and the
    difference of two depths magnifies what slows one of them)."""
    torch.manual_seed(0)
    model = StandIn(shape, layers).to(device=device, dtype=dtype)
    x = torch.randint(0, shape.vocab_size, (batch, seq + 1), device=device)

    def step() -> None:  # the device's work inside the time: synchronized after
        model(x).backward()
        _synchronize(device)

    def before_each() -> None:  # untimed: the last step's gradients and pending work
        model.zero_grad(set_to_none=True)
        _synchronize(device)

    return min(_step_times(step, steps, warmup, before_each))


def calibrate_device(spec: Device, shape: ModelShape, batch: int, seq: int,
                     device: torch.device, dtype: torch.dtype = torch.bfloat16,
                     steps: int = 5) -> tuple[Device, dict[str, float]]:
    """``spec`` (the datasheet's device) with the efficiency ``shape`` reaches on
    ``device`` at ``batch`` x ``seq`` (Note [calibrating on one GPU]), and what was measured:
    seconds of one block (``block``) and of the rest (``rest``), FLOP/s (``rate``)."""
    try:
        one = stand_in_seconds(shape, 1, batch, seq, device, dtype, steps)
        two = stand_in_seconds(shape, 2, batch, seq, device, dtype, steps)
    except torch.OutOfMemoryError:
        raise ProjectionError(f"calibrating {shape.name}: two of its blocks with the embedding "
                              f"and head at {batch} x {seq} tokens do not fit this device's "
                              "memory; calibrate a smaller micro-batch (--batch over "
                              "--grad-accum) and give the rest as --grad-accum") from None
    if two <= one:
        raise ProjectionError(f"calibrating {shape.name}: two blocks took no longer than one "
                              f"({two * 1e3:.2f} ms against {one * 1e3:.2f} ms), too little "
                              "work to time; raise --batch or --seq, or calibrate on a quieter "
                              "machine")
    block, rest = two - one, max(2 * one - two, 0.0)
    seconds = shape.n_layers * block + rest
    # the FLOPs the projection executes for this micro-batch (costs._flat), forward and
    # backward: at the efficiency below it takes ``seconds`` again
    rate = 3 * batch * seq * (shape.n_layers * shape.block_forward_flops(seq)
                              + shape.head_forward_flops) / seconds
    efficiency = rate / spec.peak_flops
    if efficiency > 1:
        raise ProjectionError(f"calibrating {shape.name}: this device ran {rate / 1e12:,.1f} "
                              f"TFLOP/s, above {spec.name}'s datasheet peak of "
                              f"{spec.peak_flops / 1e12:,.0f}: name the GPU this is with --gpu")
    return spec.with_overrides(efficiency=efficiency), {"block": block, "rest": rest,
                                                         "rate": rate}
