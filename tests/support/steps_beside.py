"""Steps of a sharded model beside a single-process copy, for the conformance files that
drive a model through something other than ``model(x)`` (a custom forward method, two
forwards per backward, a GradScaler): the caller says how a loss is computed."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from support.cast_reference import CastReference, assert_same_shards


def rank_rows(*shape: int) -> torch.Tensor:
    """Rows only this rank draws (each rank's differ)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 + dist.get_rank()))


def rank_tokens(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape,
                         generator=torch.Generator().manual_seed(2000 + dist.get_rank()))


def steps_beside(model: nn.Module, master: nn.Module, what: str,
                 loss_of: Callable[[nn.Module], torch.Tensor], steps: int = 3) -> None:
    """Adam on both; after every backward the losses, shards and gradients are equal bit
    for bit (both sum the ranks' gradients in the same order), and the weights after the
    last step."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, None, None)
    for step in range(steps):
        loss = loss_of(model)
        loss.backward()
        ref_loss = reference.forward_backward(loss_of)
        reference.reduce()
        assert torch.equal(loss.detach(), ref_loss), f"{what}, step {step}: {loss} {ref_loss}"
        assert_same_shards(model, master, f"{what}, step {step}")
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        reference.step(set_to_none=step % 2 == 0)
    assert_same_shards(model, master, f"{what}, after the last step", grads=False)
