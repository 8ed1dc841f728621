"""A small GPT (decoder-only transformer), readable top to bottom.

Used by the trainer, the memory estimator, the examples, the tests and the benchmarks. ``layers`` holds the blocks
(the natural unit for ``fully_shard``); the output projection shares its weight
with the token embedding when ``tie_embeddings`` is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 512
    """Number of token ids."""
    seq_len: int = 64
    """Longest sequence the position embedding covers."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block (must divide d_model)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}")

    def num_params(self) -> int:
        d, v = self.d_model, self.vocab_size
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * self.mlp_ratio * d * d \
            + self.mlp_ratio * d + d
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.seq_len * d + self.n_layers * block + 2 * d + head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if not self.tok_emb.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init; call after ``to_empty`` when the model was built on meta."""
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            elif name.endswith("proj.weight"):  # residual projections, scaled by depth
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


# The model shape of each of the trainer's presets (``fullshard train --preset NAME``), by
# name: what ``fullshard.memory.estimate`` sizes for a preset name. The presets' other
# settings, and why each is this size, are in fullshard/train/config.py.
SHAKESPEARE_VOCAB = 65  # distinct characters in the shipped tinyshakespeare.txt

PRESET_SHAPES: dict[str, GPTConfig] = {
    "debug": GPTConfig(vocab_size=SHAKESPEARE_VOCAB, seq_len=32, d_model=32, n_layers=2,
                       n_heads=2),
    "shakespeare": GPTConfig(vocab_size=SHAKESPEARE_VOCAB, seq_len=128, d_model=256,
                             n_layers=4, n_heads=4),
    "gpt2-124m": GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12,
                           n_heads=12),
    "llama-1b": GPTConfig(vocab_size=128256, seq_len=2048, d_model=2048, n_layers=16,
                          n_heads=32),
}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
