"""Named training configurations, and the model each one builds.

``PRESETS[name]`` is a complete :class:`TrainConfig`; ``--config`` files and command-line
flags are applied on top of a copy (:func:`get_preset`). The model shape of a preset is a
plain :class:`GPTConfig`, so a preset can be sized without training it::

    from fullshard.train.presets import PRESETS, build_model
    model = build_model(PRESETS["gpt2-124m"].gpt, device="meta")   # no memory allocated

- ``debug``: a tiny GPT that trains for a few seconds (tests, smoke runs).
- ``shakespeare`` (the default): a character-level GPT on Tiny Shakespeare, sized to
  finish in about 5 minutes on 2 CPU cores: 3.2M parameters (d_model 256, 4 layers,
  context 128), 400 steps of 2 ranks x 16 x 128 tokens. A step costs each rank ~0.6 s
  of CPU; the 10.8M-parameter shape of nanoGPT's character model (d_model 384, 6
  layers, context 256) costs ~2 s for the same tokens, so 5 minutes would buy it
  fewer than 150 steps.
- ``gpt2-124m``: GPT-2 small (124,439,808 parameters) with llm.c's 10B-token schedule,
  for GPUs: bf16, 8 ranks x 8 micro-batches x 8 x 1024 tokens = 524,288 tokens a step.
- ``llama-1b``: Llama-3.2-1B's dimensions (d_model 2048, 16 layers, 32 heads, MLP hidden
  8192, vocab 128,256, tied embeddings) on the GPT block: LayerNorm, a GELU MLP and full
  multi-head attention with learned positions, 1.07B parameters where Llama's RMSNorm,
  SwiGLU and grouped-query attention make 1.24B. It has Llama's memory and compute
  profile to within about 15%; fine-tune a real Llama with ``--model hf:PATH``.

The GPU presets read Tiny Shakespeare unless ``--data`` names other text; their
tokenizer is the character one (see ``corpus.py``), so point them at real data.
"""

from __future__ import annotations

import copy

import torch

from .config import (BatchConfig, CheckpointConfig, ConfigError, EvalConfig, OptimConfig,
                     ParallelConfig, TrainConfig)
from ..gpt import GPT, PRESET_SHAPES, GPTConfig

DEFAULT_PRESET = "shakespeare"

PRESETS: dict[str, TrainConfig] = {
    "debug": TrainConfig(
        steps=60,
        gpt=PRESET_SHAPES["debug"],
        batch=BatchConfig(seq_len=32, batch_size=4),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5, decay_steps=60),
        eval=EvalConfig(every=20, batches=2, sample_tokens=60),
        checkpoint=CheckpointConfig(every=20),
    ),
    "shakespeare": TrainConfig(
        steps=400,
        gpt=PRESET_SHAPES["shakespeare"],
        batch=BatchConfig(seq_len=128, batch_size=16),
        optim=OptimConfig(lr=2e-3, min_lr=2e-4, warmup_steps=30, decay_steps=400),
        eval=EvalConfig(every=100, batches=4, sample_tokens=300),
        checkpoint=CheckpointConfig(every=200),
    ),
    "gpt2-124m": TrainConfig(
        steps=19073,
        gpt=PRESET_SHAPES["gpt2-124m"],
        batch=BatchConfig(seq_len=1024, batch_size=8, grad_accum=8, val_fraction=0.01),
        optim=OptimConfig(lr=6e-4, min_lr=6e-5, warmup_steps=700, decay_steps=19073),
        parallel=ParallelConfig(precision="bf16"),
        eval=EvalConfig(every=250, batches=20),
        checkpoint=CheckpointConfig(every=1000),
    ),
    "llama-1b": TrainConfig(
        steps=20000,
        gpt=PRESET_SHAPES["llama-1b"],
        batch=BatchConfig(seq_len=2048, batch_size=4, grad_accum=8, val_fraction=0.01),
        optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2000, decay_steps=20000),
        parallel=ParallelConfig(precision="bf16", activation_checkpointing=True),
        eval=EvalConfig(every=500, batches=10),
        checkpoint=CheckpointConfig(every=1000),
    ),
}


def get_preset(name: str) -> TrainConfig:
    """A copy of preset ``name`` (edit it freely)."""
    if name not in PRESETS:
        raise ConfigError(f"preset: accepted values are {', '.join(PRESETS)}; got {name!r}")
    return copy.deepcopy(PRESETS[name])


def build_model(shape: GPTConfig, device: str | torch.device = "cpu") -> GPT:
    """The GPT of ``shape`` on ``device``. On "meta" nothing is allocated (for sizing, or
    for ``to_empty`` then ``init_weights``); elsewhere the weights are initialized from
    torch's current RNG state."""
    with torch.device(device):
        return GPT(shape)


def preset_model(name: str, device: str | torch.device = "meta") -> GPT:
    """The model preset ``name`` trains, on ``device`` (default meta: for sizing)."""
    return build_model(get_preset(name).gpt, device)
