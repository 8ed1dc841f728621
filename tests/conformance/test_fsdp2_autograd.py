"""Gradients through unusual forwards, as torch's FSDP2 tests check them
(test_fully_shard_autograd.py), in our own words: a forward output left out of the loss
for some steps, a sharded module the forward never calls, and activations passed between
units inside lists, tuples, namedtuples and dicts; each trains as a single-process copy.
All cases run in one launch of two ranks.
"""

from __future__ import annotations

import collections
import copy

import torch
import torch.nn as nn

from support.side_by_side import WIDTH, train_side_by_side
from fullshard import fully_shard
from fullshard.testing import run_distributed

Pair = collections.namedtuple("Pair", "x ones")


class _TwoOutputs(nn.Module):
    """``second`` either gives a second output (which the loss may leave out) or is
    never called."""

    def __init__(self, second_output: bool):
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.second_output = second_output

    def forward(self, x):
        y = self.first(x)
        return (y, self.second(y)) if self.second_output else y


def _pack(kind, x):
    if kind is list:
        return [x]
    if kind is Pair:
        return Pair(x, torch.ones_like(x))
    return (x,) if kind is tuple else {"x": x}


def _unpack(kind, packed):
    return packed["x"] if kind is dict else packed[0]


class _Packed(nn.Module):
    """Takes and returns its activation inside a container of ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, packed):
        return _pack(self.kind, torch.relu(self.lin(_unpack(self.kind, packed))))


class _PackedChain(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.blocks = nn.Sequential(*[_Packed(kind) for _ in range(3)])

    def forward(self, x):
        return _unpack(self.kind, self.blocks(_pack(self.kind, x)))


def _unused_output(reshard_after_forward) -> None:
    torch.manual_seed(0)
    model = _TwoOutputs(second_output=True)
    reference = copy.deepcopy(model)
    fully_shard(model.first, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    steps = iter(range(100))

    def both_outputs_then_the_first(out):
        # the 2 models alternate: steps 0-2 (calls 0-5) use both outputs
        first, second = out
        return (first * second).sum() if next(steps) < 6 else first.sum()
    train_side_by_side(model, reference, f"unused output, reshard {reshard_after_forward}",
                       5, loss_of=both_outputs_then_the_first)


def _unused_module(reshard_after_forward) -> None:
    torch.manual_seed(0)
    model = _TwoOutputs(second_output=False)
    reference = copy.deepcopy(model)
    for module in (model.first, model.second, model):
        fully_shard(module, reshard_after_forward=reshard_after_forward)
    train_side_by_side(model, reference, f"unused module, reshard {reshard_after_forward}", 3)
    assert model.second.weight.grad is None


def _containers() -> None:
    for kind in (list, tuple, Pair, dict):
        torch.manual_seed(0)
        model = _PackedChain(kind)
        reference = copy.deepcopy(model)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        train_side_by_side(model, reference, f"activations in a {kind.__name__}", 3)


def _all_cases() -> None:
    for reshard in (True, False):
        _unused_output(reshard)
        _unused_module(reshard)
    _containers()


def test_gradients_flow_as_in_torchs_fsdp2_through_unusual_forwards():
    run_distributed(_all_cases, 2)
