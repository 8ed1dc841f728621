"""Frozen parameters, as torch's FSDP2 tests check them (test_fully_shard_frozen.py), in
our own words: training matches a single-process reference when frozen and trainable
parameters share a unit (bias-only fine-tuning, frozen before or after sharding), when
they sit in different units (with a no-grad step between, and unfreezing later), and
when a unit with a frozen neighbour runs several times per forward, some under no_grad.

All cases run in one launch of two ranks: spawning processes is the dominant cost.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fullshard import fully_shard
from fullshard.testing import run_distributed

WIDTH = 8


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH))


class _Reused(nn.Module):
    """A trainable layer called three times per forward (once more each time under
    no_grad) beside a frozen one."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.trained = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x = self.first(x)
        for _ in range(3):
            x = self.frozen(F.relu(self.trained(x)))
            with torch.no_grad():  # in place: x keeps its autograd history
                x += F.relu(self.trained(x))
        return x


def _step(model, optim, x, scale: float, *, grad: bool = True) -> torch.Tensor:
    """One step on ``x`` with loss ``scale * sum(outputs)``. The ranks' gradients are
    averaged, so each rank uses scale 1 and the reference, on every rank's rows at once,
    1 / world size."""
    if not grad:
        with torch.no_grad():
            return model(x).sum() * scale
    loss = model(x).sum() * scale
    loss.backward()
    optim.step()
    return loss.detach()


def _same(model, reference, what: str) -> None:
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full.detach(), ref.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: parameter {name}: {m}")
        assert p.requires_grad == ref.requires_grad, f"{what}: {name} requires_grad"


def _train(model, reference, what: str, steps: int, *, no_grad_step: int = -1,
           before_step=lambda step, m: None) -> None:
    """SGD on both (Adam would turn the rounding noise of gradients that ReLU makes
    nearly zero into lr-sized steps), ``set_to_none`` alternating as torch's tests do;
    weights compared after every step (each rank trains on its rows, the reference on
    all of them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        torch.manual_seed(100 + step)
        rows = torch.randn(4 * world, WIDTH)
        for m in (model, reference):
            before_step(step, m)
        grad = step != no_grad_step
        local = _step(model, optim, rows[4 * rank:4 * (rank + 1)], 1.0, grad=grad)
        whole = _step(reference, ref_optim, rows, 1.0 / world, grad=grad)
        dist.all_reduce(local)
        torch.testing.assert_close(local / world, whole, rtol=1e-5, atol=1e-5)
        for o in (optim, ref_optim):
            o.zero_grad(set_to_none=step % 2 == 0)
        _same(model, reference, f"{what}, step {step}")


def _freeze_all_but_biases(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if "bias" not in name:
            p.requires_grad_(False)


def _bias_only(reshard_after_forward: bool, freeze_after_sharding: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_mlp() for _ in range(3)])
    if not freeze_after_sharding:
        _freeze_all_but_biases(model)
    reference = copy.deepcopy(model)
    for mlp in model:
        fully_shard(mlp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    if freeze_after_sharding:
        _freeze_all_but_biases(model)
        _freeze_all_but_biases(reference)
    frozen_before = [p.full_tensor().clone() for n, p in model.named_parameters()
                     if "bias" not in n]
    _train(model, reference, f"biases only, reshard {reshard_after_forward}, frozen "
           f"{'after' if freeze_after_sharding else 'before'} sharding", 4)
    frozen_after = [p.full_tensor() for n, p in model.named_parameters() if "bias" not in n]
    assert all(torch.equal(a, b) for a, b in zip(frozen_before, frozen_after))
    assert all(p.grad is None for n, p in model.named_parameters() if "bias" not in n)


def _frozen_units(reshard_after_forward: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])
    reference = copy.deepcopy(model)
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, reshard_after_forward=reshard_after_forward)

    def every_other_linear(step: int, m: nn.Module) -> None:
        # frozen at first; the last step unfreezes them (as fine-tuning schedules do)
        for i in range(0, len(m), 4):
            m[i].requires_grad_(step == 2)
    _train(model, reference, f"frozen units, reshard {reshard_after_forward}", 3,
           no_grad_step=1, before_step=every_other_linear)


def _reused_with_frozen_neighbour(reshard_after_forward: bool) -> None:
    torch.manual_seed(0)
    model = _Reused()
    reference = copy.deepcopy(model)
    for module in (model.first, model.frozen, model.trained, model):
        fully_shard(module, reshard_after_forward=reshard_after_forward)
    _train(model, reference, f"reused unit, reshard {reshard_after_forward}", 4)


def _all_cases() -> None:
    for reshard in (True, False):
        for after in (False, True):
            _bias_only(reshard, after)
        _frozen_units(reshard)
        _reused_with_frozen_neighbour(reshard)


def test_frozen_parameters_train_as_torchs_fsdp2_does():
    run_distributed(_all_cases, 2)
