"""A small GPT (decoder-only transformer), readable top to bottom.

Used by the trainer, the memory estimator, the examples, the tests and the benchmarks. ``layers`` holds the blocks
(the natural unit for ``fully_shard``); the output projection shares its weight
with the token embedding when ``tie_embeddings`` is set. With ``n_experts`` each block's
MLP is a mixture of experts (Mixtral-style: a ``ModuleList`` of expert MLPs, a top-k
router, a load-balancing auxiliary loss): ``gpt_loss`` adds that loss.
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
    """Hidden width of the MLP (of each expert) as a multiple of d_model."""
    n_experts: int = 0
    """0: one MLP per block; N > 0: a mixture of N expert MLPs per block."""
    top_k: int = 2
    """Experts each token is sent to (with n_experts)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in ``gpt_loss`` (with n_experts)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"GPTConfig: top_k={self.top_k} must be between 1 and "
                             f"n_experts={self.n_experts}")

    def num_params(self) -> int:
        """Every parameter (all experts)."""
        return self._count(max(self.n_experts, 1))

    def active_params(self) -> int:
        """The parameters one token computes with (its top_k experts of each block)."""
        return self._count(min(self.top_k, self.n_experts) if self.n_experts else 1)

    def _count(self, mlps: int) -> int:
        d, v = self.d_model, self.vocab_size
        mlp = 2 * self.mlp_ratio * d * d + self.mlp_ratio * d + d
        router = d * self.n_experts
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + mlps * mlp + router
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


def top_k_routing(router: nn.Module, tokens: torch.Tensor, top_k: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixtral's routing: the router's probabilities over experts, each token's ``top_k``
    experts (``chosen``) and their probabilities renormalized over those k (``weights``)."""
    probs = router(tokens).softmax(dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    return probs, weights / weights.sum(dim=-1, keepdim=True), chosen


class MoE(nn.Module):
    """A mixture of expert MLPs, Mixtral-style: each token goes to the ``top_k`` experts
    its router scores highest, weighted by their probabilities renormalized over those k.
    An expert no token chose does not run (so its parameters get no gradient in that
    step: on one rank and not another, an everyday case sharding must handle).
    ``aux_loss`` is the Switch Transformer's load-balancing loss of the last forward:
    n_experts * sum_e (share of assignments to e) * (mean router probability of e)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs, weights, chosen = top_k_routing(self.router, tokens, self.top_k)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = self._routed(chosen, e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(tokens[token]) * weights[token, slot, None])
        n = len(self.experts)
        share = F.one_hot(chosen, n).sum(dim=(0, 1)).to(probs.dtype) / chosen.numel()
        self.aux_loss = n * (share * probs.mean(dim=0)).sum()
        return out.view_as(x)

    def _routed(self, chosen: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, slot) pairs that chose ``expert``. On the meta device (the memory
        estimator's trace) routing is unknown: every expert gets an even share."""
        if not chosen.is_meta:
            return torch.where(chosen == expert)
        count = -(-chosen.numel() // len(self.experts))
        token = torch.arange(count, device=chosen.device) % chosen.shape[0]
        return token, torch.zeros_like(token)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

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
    "moe": GPTConfig(vocab_size=SHAKESPEARE_VOCAB, seq_len=64, d_model=128, n_layers=4,
                     n_heads=4, mlp_ratio=2, n_experts=8, top_k=2),
    "gpt2-124m": GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12,
                           n_heads=12),
    "llama-1b": GPTConfig(vocab_size=128256, seq_len=2048, d_model=2048, n_layers=16,
                          n_heads=32),
}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The weighted load-balancing loss of ``model``'s last forward (mixture-of-experts
    blocks), or None for a dense model."""
    losses = [m.aux_loss for m in model.modules()
              if isinstance(m, MoE) and m.aux_loss is not None]
    if not losses:
        return None
    coef = next(m for m in model.modules() if isinstance(m, GPT)).cfg.aux_loss_coef
    return coef * torch.stack(losses).sum()


def gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model(idx)``, plus the load-balancing loss when the
    blocks are mixtures of experts."""
    loss = lm_loss(model(idx), targets)
    aux = aux_loss(model)
    return loss if aux is None else loss + aux
