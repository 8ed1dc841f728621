"""A Llama-style decoder for the GPU benchmarks: RMSNorm, SwiGLU, SDPA, untied head.

Only torch is needed (the GPU machine has no other packages). Rotary embeddings are
left out: they add elementwise work of the same size as the norms, not collectives
or parameters, so they would not change what the benchmarks compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int

    @property
    def hidden(self) -> int:
        """SwiGLU width: 8/3 d rounded up to a multiple of 64, as Llama does."""
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    def num_params(self) -> int:
        d, h = self.d_model, self.hidden
        block = 4 * d * d + 3 * d * h + 2 * d
        return 2 * self.vocab_size * d + self.n_layers * block + d

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token: 6 per parameter-token plus causal attention's
        score and value products (12 L d T, halved for the causal mask)."""
        return 6 * self.num_params() + 6 * self.n_layers * self.d_model * seq


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.d_model, 2 * cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init (the same weights for every implementation)."""
        gen = torch.Generator(device=self.output.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))
