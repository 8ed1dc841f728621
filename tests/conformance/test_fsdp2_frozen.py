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
import torch.nn as nn
import torch.nn.functional as F

from support.side_by_side import WIDTH, train_side_by_side
from fullshard import fully_shard
from fullshard.testing import run_distributed


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
    train_side_by_side(model, reference, f"biases only, reshard {reshard_after_forward}, frozen "
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
    train_side_by_side(model, reference, f"frozen units, reshard {reshard_after_forward}", 3,
           no_grad_step=1, before_step=every_other_linear)


def _reused_with_frozen_neighbour(reshard_after_forward: bool) -> None:
    torch.manual_seed(0)
    model = _Reused()
    reference = copy.deepcopy(model)
    for module in (model.first, model.frozen, model.trained, model):
        fully_shard(module, reshard_after_forward=reshard_after_forward)
    train_side_by_side(model, reference, f"reused unit, reshard {reshard_after_forward}", 4)


def _all_cases() -> None:
    for reshard in (True, False):
        for after in (False, True):
            _bias_only(reshard, after)
        _frozen_units(reshard)
        _reused_with_frozen_neighbour(reshard)


def test_frozen_parameters_train_as_torchs_fsdp2_does():
    run_distributed(_all_cases, 2)
