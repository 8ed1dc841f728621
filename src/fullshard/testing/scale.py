"""The scale lane's workloads and measures: tiny models stepped as rank 0 of a fake world.

Two workloads. ``row_blocks``: residual blocks whose every parameter's rows are a multiple
of ``ROWS``, itself a multiple of each world size measured (up to 1,024), so that a rank's
shard is exactly ``1/N`` of each parameter and the collectives' sizes follow from the
design alone; block ``i`` is ``i + 1`` times as large as the first, so that each
collective's size says which unit issued it. And
the trainer's own step (``Trainer._train_step`` and the statistics that close it,
the span the trainer reports as ``step_time_s``) on the ``debug`` preset's GPT.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..api import fully_shard
from .fake_world import BackendClock, QuietBackend, fake_world

WORLD_SIZES = (8, 64, 256, 1024)
ROWS = 1024
WIDTH = 16
BATCH = 2
# short: every step, micro-batch and rank's sequence is as long as this
TRAINER_FIELDS = {"steps": 4, "eval.every": 0, "eval.sample_tokens": 0, "checkpoint.every": 0,
                  "batch.batch_size": 1, "batch.seq_len": 16}


class RowBlock(nn.Module):
    """``x + relu(x @ up.T) @ down``: two ``hidden x WIDTH`` matrices."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(hidden, WIDTH) * 0.1)
        self.down = nn.Parameter(torch.randn(hidden, WIDTH) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(x @ self.up.T) @ self.down


def row_blocks(blocks: int = 4) -> nn.Sequential:
    """``blocks`` RowBlocks, seeded (every world size builds the same model)."""
    torch.manual_seed(0)
    return nn.Sequential(*[RowBlock(ROWS * (i + 1)) for i in range(blocks)])


def shard_row_blocks(model: nn.Sequential, shard: Callable = fully_shard,
                     **kwargs) -> nn.Sequential:
    """Each block a unit, then the root (no parameters of its own). fullshard does not merge
    the blocks into one collective (bucket numel 0): one unit, one collective."""
    for block in model:
        shard(block, **kwargs)
    shard(model, **kwargs)
    if hasattr(model, "set_bucket_numel"):
        model.set_bucket_numel(0)
    return model


class BlocksRun:
    """``row_blocks`` sharded by ``shard`` (fullshard's or torch's fully_shard) in the
    current world, with the trainer's optimizer (fused AdamW, train/loop.py) and a batch."""

    def __init__(self, shard: Callable = fully_shard) -> None:
        self.model = shard_row_blocks(row_blocks(), shard)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        self.x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))

    def forward_backward(self) -> None:
        self.model(self.x).square().mean().backward()

    def step(self) -> None:
        """One training step: forward, backward, the optimizer's step, zero_grad."""
        self.forward_backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class ShardBytes:
    """Bytes of this rank's local shards."""

    params: int
    grads: int
    states: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.states


def shard_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> ShardBytes:
    """This rank's shards of ``model``'s parameters and gradients (call between backward
    and zero_grad) and of ``optimizer``'s states (after its first step)."""
    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    params = list(model.parameters())
    states = [v for p in params for v in optimizer.state.get(p, {}).values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]  # not the step counters
    return ShardBytes(sum(local_bytes(p) for p in params),
                      sum(local_bytes(p.grad) for p in params if p.grad is not None),
                      sum(local_bytes(s) for s in states))


def trainer(world: int):
    """The trainer of the ``debug`` preset, as rank 0 of ``world`` (in a fake world of
    that size)."""
    from ..train.config.flags import apply_overrides
    from ..train.config.schema import get_preset
    from ..train.launch.launcher import Worker
    from ..train.loop import Trainer
    cfg = apply_overrides(get_preset("debug"), TRAINER_FIELDS, "scale")
    # the run's folder is written by Trainer.run only, which the lane never calls
    out = os.path.join(tempfile.gettempdir(), "fullshard-scale-unwritten")
    return Trainer(cfg, out, Worker(0, world, 0, world, torch.device("cpu")))


def trainer_step(run) -> dict:
    """One step of ``run`` (a Trainer) as its training loop takes most: the optimizer step
    over the micro-batches, the statistics, the metrics read from them (not one of the
    steps that also gather every rank's peak)."""
    from ..train.report.metrics import metrics_fields
    loss, grad_norm = run._train_step()
    stats = run._gather_stats(loss, grad_norm)
    return metrics_fields(stats.figures, stats.peaks)


def python_calls(fn: Callable[[], object]) -> int:
    """Calls made while ``fn()`` runs: of Python functions, and of C functions from Python
    (``int(t)``, a tensor method): a loop over ranks in either shows."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@dataclass(frozen=True)
class HostTime:
    """Median seconds per step: in all, inside the process group's collectives, and
    outside them (``own``: the caller's host work, each step's total less its backend);
    ``own_best``, the least ``own`` of any step: what a machine shared with other work
    adds only ever lengthens a step, so the least is the steadiest figure there."""

    total: float
    backend: float
    own: float
    own_best: float


def host_times(build: Callable[[int], Callable[[], object]], sizes=WORLD_SIZES,
               rounds: int = 3, steps: int = 8, warmup: int = 3,
               quiet: bool = False) -> dict[int, HostTime]:
    """Per world size, the median over ``rounds x steps`` timed steps of the step that
    ``build(world)`` returns (built in a fake world of that size). The sizes take turns,
    round after round, so that a slow spell of a shared machine falls on all of them.
    ``quiet``: the timed steps' collectives move no data (``QuietBackend``), so that
    ``own`` is the caller's host work alone."""
    samples: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            with fake_world(n):
                step = build(n)
                for _ in range(warmup):
                    step()
                if quiet:
                    with QuietBackend():
                        samples[n] += _timed_steps(step, steps)
                else:
                    samples[n] += _timed_steps(step, steps)
    return {n: HostTime(statistics.median(t for t, _ in s), statistics.median(b for _, b in s),
                        statistics.median(t - b for t, b in s), min(t - b for t, b in s))
            for n, s in samples.items()}


def _timed_steps(step: Callable[[], object], steps: int) -> list[tuple[float, float]]:
    # collected before, not during: a collection inside one step is noise, not its cost
    gc.collect()
    gc.disable()
    try:
        out = []
        for _ in range(steps):
            with BackendClock() as clock:
                started = time.thread_time()
                step()
                out.append((time.thread_time() - started, clock.seconds))
        return out
    finally:
        gc.enable()

