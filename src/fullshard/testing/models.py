"""Small models that exercise the awkward corners of sharding.

Each model's docstring says which corner it covers. All are deterministic given the
global seed, tiny, and come with a ``batch(step, n)`` maker and a ``loss``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def float_batch(step: int, n: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def token_batch(step: int, n: int, vocab_size: int, seq_len: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets (the ids rolled by one)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab_size, (n, seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def mse_loss(model: nn.Module, batch) -> torch.Tensor:
    """The loss in the targets' dtype (as torch promotes it; torch 2.11's backward of
    ``mse_loss`` fails when the output's dtype differs from the targets')."""
    x, y = batch
    return F.mse_loss(model(x).to(y.dtype), y)


class OddMLP(nn.Module):
    """Odd sizes (7 -> 13 -> 5 -> 3): every shard is padded, some ranks own fewer rows."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(7, 13), nn.Tanh()),
            nn.Sequential(nn.Linear(13, 5), nn.Tanh()),
        )
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.blocks(x))


class TwiceCalled(nn.Module):
    """``shared`` runs twice per forward; its gradient is the sum of both uses."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.shared(self.shared(h)) + h)


class _FrozenUnusedBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 9)
        self.trained = nn.Linear(9, 4)
        self.unused = nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.trained(torch.tanh(self.frozen(x))))


class WithUnusedAndFrozen(nn.Module):
    """One unit mixes a frozen weight, a trainable one, and a parameter forward never uses."""

    def __init__(self):
        super().__init__()
        self.body = _FrozenUnusedBody()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))


class RowVector(nn.Module):
    """A (1, d) parameter: on 2+ ranks every rank but the first holds an empty shard.
    Also carries a buffer (not sharded) that forward reads."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(1, 5))
        self.proj = nn.Linear(5, 3)
        self.register_buffer("offset", torch.linspace(-1, 1, 5))

    def forward(self, x):
        return self.proj(x * self.scale + self.offset)


class KwargsDict(nn.Module):
    """Forward takes keyword arguments and returns a dict."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 7)
        self.dec = nn.Linear(7, 3)

    def forward(self, x, *, gain: float = 1.0, mask=None):
        h = torch.tanh(self.enc(x)) * gain
        if mask is not None:
            h = h * mask
        return {"out": self.dec(h), "hidden": h}


def kwargs_dict_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    res = model(x, gain=0.5, mask=torch.ones(7))
    return F.mse_loss(res["out"], y) + 0.1 * res["hidden"].pow(2).mean()
