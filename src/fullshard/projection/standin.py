"""A stand-in for a model shape: the blocks a GPU calibration times (calibrate.py).

``StandIn(shape, layers)`` is a language model of ``shape``'s width (its attention widths,
key/value heads, MLP, vocabulary, tied or untied head, learned positions or rotary
embedding) with ``layers`` blocks instead of ``shape.n_layers``, so that a model too large
for one GPU is timed a block at a time. Its matrices are the ones the projection counts
(``ModelShape.block_matrix_params``), its attention is SDPA's causal kernel (flash
attention on a GPU), its norms and activation PyTorch's eager kernels; nothing in it is
trained: it exists to be timed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .hardware import ProjectionError
from .shapes import ModelShape


def _norm(shape: ModelShape) -> type[nn.Module]:
    """RMSNorm in a Llama-style (gated MLP) model, LayerNorm in a GPT-style one."""
    return nn.RMSNorm if shape.gated_mlp else nn.LayerNorm


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Block(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        d, q, kv = shape.d_model, shape.q_width, shape.kv_width
        self.heads, self.kv_heads, self.head_width = (shape.n_heads, shape.n_kv_heads,
                                                      shape.head_width)
        self.widths = [q, kv, kv]
        self.norm1, self.norm2 = _norm(shape)(d), _norm(shape)(d)
        self.qkv = nn.Linear(d, q + 2 * kv, bias=False)
        self.out = nn.Linear(q, d, bias=False)
        f = shape.mlp_width
        self.up = nn.Linear(d, 2 * f if shape.gated_mlp else f, bias=False)
        self.down = nn.Linear(f, d, bias=False)
        self.gated = shape.gated_mlp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
                ) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(self.widths, -1)
        q = q.view(b, s, self.heads, self.head_width).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_width).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_width).transpose(1, 2)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        # grouped-query attention: SDPA shares each group's keys without copying them
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, -1))
        h = self.up(self.norm2(x))
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return x + self.down(h)


class StandIn(nn.Module):
    """``shape`` with ``layers`` blocks (module docstring); ``forward(tokens)`` returns the
    mean next-token cross-entropy."""

    def __init__(self, shape: ModelShape, layers: int):
        super().__init__()
        if shape.n_experts:
            raise ProjectionError(
                f"{shape.name}: a mixture of experts cannot be calibrated on one GPU (its "
                "routing is not timed here); project it from the fitted model, or give "
                "--efficiency")
        d = shape.d_model
        self.embed = nn.Embedding(shape.vocab_size, d)
        self.positions = nn.Embedding(shape.learned_positions, d) \
            if shape.learned_positions else None
        self.blocks = nn.ModuleList(_Block(shape) for _ in range(layers))
        self.norm = _norm(shape)(d)
        self.head = nn.Linear(d, shape.vocab_size, bias=False)
        if shape.tied:
            self.head.weight = self.embed.weight
        self.head_width = shape.head_width

    def _rope(self, seq: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.head_width // 2
        freq = 1.0 / 10000 ** (torch.arange(half, device=like.device) / half)
        angles = torch.outer(torch.arange(seq, device=like.device), freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        seq = inputs.shape[1]
        x = self.embed(inputs)
        rope = None
        if self.positions is not None:
            x = x + self.positions(torch.arange(seq, device=x.device))
        else:
            rope = self._rope(seq, x)
        for block in self.blocks:
            x = block(x, rope)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
