"""What a run trains: the model (not yet sharded), how to get its logits, and the data."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from . import hf
from .config import ConfigError, TrainConfig
from .corpus import CharTokenizer, Tokenizer, read_documents, split, tokenize
from .presets import build_model


@dataclass
class Workload:
    model: nn.Module
    logits: Callable[[torch.Tensor], torch.Tensor]
    """ids (batch x time) -> logits (batch x time x vocab), through the model's forward."""
    tokenizer: Tokenizer
    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    context: int
    """Longest input the model is given (the sample's sliding window)."""
    initial_state: dict
    """Rank 0's initial weights (a full state dict; empty on other ranks, whose model is
    on the meta device), to broadcast into the sharded model (initial_weights.py)."""


def build_workload(cfg: TrainConfig, rank: int) -> Workload:
    """Load the data and the model: rank 0 loads the Hugging Face model or builds the GPT
    (on the CPU, from ``cfg.seed``); the other ranks build it on the meta device and receive
    rank 0's weights after sharding (initial_weights.py)."""
    documents = read_documents(cfg.data)
    if cfg.is_hf:
        model = hf.load_model(cfg.hf_path, on_meta=rank != 0)
        tokenizer = hf.load_tokenizer(cfg.hf_path, hf.vocab_size(model))
        logits = functools.partial(hf.logits, model)
    else:
        tokenizer = CharTokenizer(documents)
        if tokenizer.vocab_size > cfg.gpt.vocab_size:
            raise ConfigError(f"gpt.vocab_size: the data has {tokenizer.vocab_size} distinct "
                              f"characters, more than {cfg.gpt.vocab_size}; raise it to "
                              f"at least {tokenizer.vocab_size}")
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.gpt, "cpu" if rank == 0 else "meta")
        logits = model
    initial_state = model.state_dict() if rank == 0 else {}
    train_tokens, val_tokens = split(tokenize(documents, tokenizer), cfg.batch.val_fraction)
    return Workload(model, logits, tokenizer, train_tokens, val_tokens, cfg.batch.seq_len,
                    initial_state)
