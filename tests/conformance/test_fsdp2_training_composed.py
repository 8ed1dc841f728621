"""Training composed with other torch features, as torch's FSDP2 tests check it (the
composed tests of test_fully_shard_training.py), in our own words:

- activation checkpointing three ways (torch's composable ``checkpoint(module)``,
  ``torch.utils.checkpoint`` inside the block, ``apply_activation_checkpointing``'s
  wrapper) times three ways of grouping units: one per block; a memory-lean grouping
  (two blocks as one unit, the embeddings as one with ``set_unshard_in_backward(False)``,
  the final norm and head as one); the embedding and the tied head as one unit;
- two forwards before one backward (a DPO-style loss) through nested units (a block's
  two halves, the block, the root), with composable or in-block checkpointing;
- ``register_fsdp_forward_method``: the root calls a child unit's ``forward_features``
  rather than its ``forward``;
- ``share_comm_ctx`` over several roots (pipeline stages); a non-FSDP module is refused
  with torch's words;
- ``torch.vmap`` inside a unit's forward, and a unit called under ``torch.vmap``.

Each case trains beside a single-process copy fed every rank's rows, bit for bit
(tests/support/steps_beside.py). All cases run in one launch of two ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing)
from torch.utils.checkpoint import checkpoint

from support.steps_beside import rank_rows, rank_tokens, steps_beside
from fullshard import fully_shard, register_fsdp_forward_method, share_comm_ctx
from fullshard.testing import run_distributed

DIM, VOCAB, SEQ = 16, 64, 8


class _Half(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, width)
        self.down = nn.Linear(width, DIM)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class _Block(nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.mix = _Half(DIM)
        self.ffn = _Half(2 * DIM)
        self.checkpointed = checkpointed

    def _run(self, x):
        return self.ffn(self.mix(x))

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self._run, x, use_reentrant=False)
        return self._run(x)


class _LM(nn.Module):
    def __init__(self, tied: bool, checkpointed: bool = False):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(_Block(checkpointed) for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.output.weight = self.tok.weight

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _group(model: _LM, grouping: str, **kwargs) -> None:
    if grouping == "block":
        for layer in model.layers:
            fully_shard(layer, **kwargs)
    elif grouping == "lean":
        fully_shard(model.layers[0], **kwargs)
        fully_shard([model.layers[1], model.layers[2]], **kwargs)
        fully_shard([model.tok, model.pos], **kwargs)
        model.tok.set_unshard_in_backward(False)  # an embedding's backward needs no weight
        fully_shard([model.norm, model.output], **kwargs)
    else:  # "tied": the embedding and the head it shares a weight with, one unit
        fully_shard([model.tok, model.output], **kwargs)
        for layer in model.layers:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def _checkpointed_training(how: str, grouping: str, reshard_after_forward: bool) -> None:
    torch.manual_seed(42)
    model = _LM(tied=grouping != "lean", checkpointed=how == "utils")
    master = copy.deepcopy(model)
    if how == "wrapper":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, _Block))
    elif how == "composable":
        for layer in model.layers:
            composable_checkpoint(layer)
    _group(model, grouping, reshard_after_forward=reshard_after_forward)
    tokens = rank_tokens(VOCAB, 3, SEQ)
    steps_beside(model, master, f"checkpoint {how}, {grouping}, reshard {reshard_after_forward}",
                 lambda m: m(tokens).sum())


def _two_forwards_one_backward(how: str, reshard_after_forward: bool) -> None:
    torch.manual_seed(42)
    model = _LM(tied=True, checkpointed=how == "utils")
    master = copy.deepcopy(model)
    for layer in model.layers:
        if how == "composable":
            composable_checkpoint(layer)
        fully_shard(layer.mix, reshard_after_forward=reshard_after_forward)
        fully_shard(layer.ffn, reshard_after_forward=reshard_after_forward)
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    chosen, rejected = rank_tokens(VOCAB, 2, SEQ), rank_tokens(VOCAB, 2, SEQ).flip(0)
    steps_beside(model, master, f"two forwards, checkpoint {how}, reshard {reshard_after_forward}",
                 lambda m: (m(chosen).sum() - m(rejected).sum()).pow(2) * 1e-4)


class _Vision(nn.Module):
    def __init__(self):
        super().__init__()
        self.patches = nn.Conv2d(3, 32, kernel_size=4, stride=4)

    def forward_features(self, images):
        return self.patches(images).flatten(2).transpose(1, 2)

    def forward(self, images):
        return self.forward_features(images).sum(dim=1)


class _WithProjector(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision = _Vision()
        self.projector = nn.Linear(32, 8)

    def forward(self, images):
        return self.projector(self.vision.forward_features(images))  # not vision.forward


def _custom_forward_method() -> None:
    torch.manual_seed(42)
    model = _WithProjector()
    master = copy.deepcopy(model)
    fully_shard(model.vision)
    fully_shard(model.projector)
    fully_shard(model)
    register_fsdp_forward_method(model.vision, "forward_features")
    images = rank_rows(2, 3, 16, 16)
    steps_beside(model, master, "register_fsdp_forward_method", lambda m: m(images).sum())


def _shared_comm_ctx() -> None:
    torch.manual_seed(42)
    stages = nn.Sequential(*[_Half(2 * DIM) for _ in range(3)])
    master = copy.deepcopy(stages)
    for stage in stages:
        fully_shard(stage)  # each stage its own root, as pipeline stages are
    share_comm_ctx(list(stages))
    x = rank_rows(4, 3, DIM)
    steps_beside(stages, master, "share_comm_ctx", lambda m: m(x).sum())
    with pytest.raises(ValueError, match="Expects list of FSDPModules"):
        share_comm_ctx([stages[0], nn.Linear(2, 2)])


class _PerRow(nn.Module):
    """A unit whose forward maps its layers over rows with torch.vmap."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return torch.vmap(lambda row: self.down(torch.relu(self.up(row))))(x)


class _MappedUnit(nn.Module):
    """A root that calls a unit under torch.vmap."""

    def __init__(self):
        super().__init__()
        self.inner = _Half(DIM)
        self.outer = _PerRow()

    def forward(self, x):
        return self.outer(torch.vmap(self.inner, in_dims=1, out_dims=1)(x))


def _vmap_in_units(reshard_after_forward: bool) -> None:
    torch.manual_seed(42)
    model = _MappedUnit()
    master = copy.deepcopy(model)
    fully_shard(model.inner, reshard_after_forward=reshard_after_forward)
    fully_shard(model.outer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    x = rank_rows(4, 3, DIM)
    steps_beside(model, master, f"vmap, reshard {reshard_after_forward}",
                 lambda m: m(x).pow(2).sum())


def _all_cases() -> None:
    for how in ("composable", "utils", "wrapper"):
        for grouping in ("block", "lean", "tied"):
            for reshard in (True, False):
                _checkpointed_training(how, grouping, reshard)
    for how in ("composable", "utils"):
        for reshard in (True, False):
            _two_forwards_one_backward(how, reshard)
    _custom_forward_method()
    _shared_comm_ctx()
    for reshard in (True, False):
        _vmap_in_units(reshard)


@pytest.mark.extended  # make test has no time left: CI runs it in the extended lane
def test_composed_training_matches_a_single_process_copy_as_in_torchs_fsdp2():
    run_distributed(_all_cases, 2)
