"""Shared parameters in a transformer, as torch's FSDP2 tests train them
(test_fully_shard_shared_params.py), in our own words: a token embedding that is also
the output projection (one parameter, used twice in the root unit), every encoder and
decoder layer of ``nn.Transformer`` a unit, with a float and an integer buffer in the
root, ``reshard_after_forward`` True/False, with and without activation checkpointing
on the layers (torch's composable ``checkpoint``). Losses, gradients and weights match
a single-process copy fed every rank's tokens, step by step; the two uses of the tied
weight stay one parameter. All cases in one launch of two ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint

from support.cast_reference import CastReference, assert_same_shards
from fullshard import fully_shard
from fullshard.testing import run_distributed

VOCAB, WIDTH = 23, 16
CLOSE = {"rtol": 1e-5, "atol": 1e-6}


class _TiedTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(d_model=WIDTH, nhead=2, num_encoder_layers=2,
                                          num_decoder_layers=2, dim_feedforward=8,
                                          dropout=0.0)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.embed.weight
        self.register_buffer("offset", torch.full((WIDTH,), 0.5))
        self.register_buffer("count", torch.zeros(WIDTH, dtype=torch.long))

    def forward(self, source, target):
        src = self.embed(source) + self.offset + self.count.type_as(self.offset)
        return self.head(self.transformer(src, self.embed(target)))


def _layers(model: _TiedTransformer):
    return [*model.transformer.encoder.layers, *model.transformer.decoder.layers]


def _tokens(step: int):
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.randint(0, VOCAB, (6, 2), generator=g), torch.randint(0, VOCAB, (4, 2),
                                                                       generator=g)


def _shared(reshard: bool, checkpointed: bool) -> None:
    what = f"tied embedding, reshard {reshard}, checkpointed {checkpointed}"
    torch.manual_seed(42)
    model = _TiedTransformer()
    master = copy.deepcopy(model)
    for layer in _layers(model):
        if checkpointed:
            checkpoint(layer)
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    assert model.head.weight is model.embed.weight
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, None, None)
    for step in range(4):
        source, target = _tokens(step)
        loss = model(source, target).sum()
        loss.backward()
        ref_loss = reference.forward_backward(lambda m: m(source, target).sum())
        torch.testing.assert_close(loss.detach(), ref_loss, **CLOSE,
                                   msg=lambda m: f"{what}, step {step}: {m}")
        reference.reduce()
        assert_same_shards(model, master, f"{what}, step {step}", **CLOSE)
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        reference.step(set_to_none=step % 2 == 0)
    assert model.head.weight is model.embed.weight
    assert_same_shards(model, master, f"{what}, trained", grads=False, **CLOSE)


def _all_cases() -> None:
    for reshard in (False, True):
        for checkpointed in (False, True):
            _shared(reshard, checkpointed)


@pytest.mark.extended  # make test has no time left: CI runs it in the extended lane
def test_shared_parameters_train_as_torchs_fsdp2_does():
    run_distributed(_all_cases, 2)
