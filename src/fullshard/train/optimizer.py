"""AdamW over the sharded parameters, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .config import OptimConfig


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (and embeddings) only: decaying biases and
    norm gains pulls them towards zero for no regularizing benefit."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2))


def learning_rate(step: int, optim: OptimConfig) -> float:
    """The rate for optimizer step ``step`` (1-based): linear warmup to ``lr`` over
    ``warmup_steps``, cosine decay to ``min_lr`` at ``decay_steps``, then ``min_lr``.
    ``decay_steps`` must already be resolved (non-zero)."""
    if step <= optim.warmup_steps:
        return optim.lr * step / optim.warmup_steps
    span = max(1, optim.decay_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
