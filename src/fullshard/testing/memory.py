"""Training steps under a MemoryTracker: what measured-memory tests and benchmarks run."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..memory import MemoryTracker


def tracked_steps(model: nn.Module, tracker: MemoryTracker, batches: Iterable,
                  loss_of: Callable[..., torch.Tensor], optimizers: Callable | None = None
                  ) -> dict:
    """One optimizer step over what trains per batch (``loss_of(*batch)``), each phase
    under ``tracker``: the last step's report (``MemoryTracker.step_report``).
    ``optimizers(model)`` builds them (default: one AdamW)."""
    tracker.watch(model)
    optims = optimizers(model) if optimizers is not None else [
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)]
    report = {}
    for batch in batches:
        with tracker.phase("forward"):
            loss = loss_of(*batch)
        with tracker.phase("backward"):
            loss.backward()
        with tracker.phase("optimizer"):
            for optim in optims:
                optim.step()
                optim.zero_grad(set_to_none=True)
        report = tracker.step_report()
    return report


def tracked_token_steps(model: nn.Module, tracker: MemoryTracker, vocab_size: int, batch: int,
                        seq: int, loss_of: Callable[[torch.Tensor], torch.Tensor],
                        optimizers: Callable | None = None) -> dict:
    """Two optimizer steps over random token batches (seeded by the rank), each phase
    under ``tracker``: the second step's report."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = ((torch.randint(0, vocab_size, (batch, seq), generator=gen),) for _ in range(2))
    return tracked_steps(model, tracker, batches, loss_of, optimizers)
