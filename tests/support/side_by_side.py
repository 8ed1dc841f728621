"""Training a sharded model beside a single-process copy, step by step, the way torch's
FSDP2 tests compare against DDP: each rank trains on its rows of a batch, the reference on
all of them, and the weights must agree after every step."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

WIDTH = 8  # the input width of the models these tests build


def _step(model, optim, x, scale: float, loss_of, *, grad: bool = True) -> torch.Tensor:
    """One step on ``x`` with loss ``scale * loss_of(model(x))``. The ranks' gradients
    are averaged, so each rank uses scale 1 and the reference, on every rank's rows at
    once, 1 / world size (``loss_of`` must add up over rows, as a sum does)."""
    if not grad:
        with torch.no_grad():
            return loss_of(model(x)) * scale
    loss = loss_of(model(x)) * scale
    loss.backward()
    optim.step()
    return loss.detach()


def _same(model: nn.Module, reference: nn.Module, what: str) -> None:
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full.detach(), ref.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: parameter {name}: {m}")
        assert p.requires_grad == ref.requires_grad, f"{what}: {name} requires_grad"


def train_side_by_side(model: nn.Module, reference: nn.Module, what: str, steps: int, *,
                       loss_of: Callable = lambda out: out.sum(), no_grad_step: int = -1,
                       before_step: Callable[[int, nn.Module], None] = lambda step, m: None
                       ) -> None:
    """SGD on both (Adam would turn the rounding noise of gradients that ReLU makes
    nearly zero into lr-sized steps), ``set_to_none`` alternating as torch's tests do;
    losses and weights compared after every step; step ``no_grad_step`` is a forward
    under no_grad only. ``before_step(step, m)`` runs on both models first."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        torch.manual_seed(100 + step)
        rows = torch.randn(4 * world, WIDTH)
        for m in (model, reference):
            before_step(step, m)
        grad = step != no_grad_step
        local = _step(model, optim, rows[4 * rank:4 * (rank + 1)], 1.0, loss_of, grad=grad)
        whole = _step(reference, ref_optim, rows, 1.0 / world, loss_of, grad=grad)
        dist.all_reduce(local)
        torch.testing.assert_close(local / world, whole, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{what}, step {step}: loss: {m}")
        for o in (optim, ref_optim):
            o.zero_grad(set_to_none=step % 2 == 0)
        _same(model, reference, f"{what}, step {step}")
