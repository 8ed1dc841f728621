"""Ignored parameters, as torch's FSDP2 test_fully_shard_ignore_params.py checks them, in
our own words: a submodule's parameters passed as ``ignored_params`` stay plain tensors
outside every unit, and DDP wrapped around the model, told to skip what fully_shard
manages, keeps them in sync, so the whole trains as plain DDP does. One launch.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import FSDPModule, fully_shard
from fullshard.testing import run_distributed

WIDTH = 8


class _Inner(nn.Module):
    """A linear layer fed by a nested one, minus a bias-like parameter of its own."""

    def __init__(self):
        super().__init__()
        self.outer_lin = nn.Linear(WIDTH, WIDTH)
        self.nested = nn.Sequential(nn.Linear(WIDTH, WIDTH))
        self.offset = nn.Parameter(torch.randn(WIDTH, WIDTH))

    def forward(self, x):
        return self.outer_lin(self.nested(x)) - self.offset


class _Whole(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.shift = nn.Parameter(torch.randn(WIDTH, WIDTH))

    def forward(self, x):
        return (self.inner(x) + self.shift).sum()


def _ddp_around_fully_shard_with_ignored() -> None:
    torch.manual_seed(0)
    model = _Whole()
    reference = DDP(copy.deepcopy(model))
    ignored = set(model.inner.nested.parameters())
    fully_shard(model.inner.outer_lin, ignored_params=ignored)
    fully_shard(model.inner, ignored_params=ignored)
    units = {name for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    assert units == {"inner", "inner.outer_lin"}, units
    kinds = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
    assert kinds == {"inner.outer_lin.weight": True, "inner.outer_lin.bias": True,
                     "inner.offset": True, "inner.nested.0.weight": False,
                     "inner.nested.0.bias": False, "shift": False}, kinds
    managed = [n for n, is_sharded in kinds.items() if is_sharded]
    DDP._set_params_and_buffers_to_ignore_for_model(model, managed)
    model = DDP(model, broadcast_buffers=False)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.05)
    x = torch.randn(WIDTH, WIDTH)  # the same on every rank, as in torch's test
    for step in range(3):
        loss, ref_loss = model(x), reference(x)
        torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"step {step}: {m}")
        loss.backward()
        ref_loss.backward()
        with implicit_replication():
            for o in (optim, ref_optim):
                o.step()
                o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            torch.testing.assert_close(full, q, msg=lambda m: f"step {step}, {name}: {m}")


def test_ignored_parameters_left_to_ddp_train_as_plain_ddp():
    run_distributed(_ddp_around_fully_shard_with_ignored, 2)
