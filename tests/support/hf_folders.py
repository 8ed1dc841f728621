"""Folders the Hugging Face and fine-tuning tests read: a tiny Llama saved by
transformers, a JSON-lines dataset, and a fullshard run's folder (config and checkpoint)."""

from __future__ import annotations

import json
import os

import torch

from fullshard import checkpoint
from fullshard.train.config.schema import get_preset, to_toml
from fullshard.train.config.flags import apply_overrides
from fullshard.train.data import load_text
from fullshard.train.model import build_model


def save_tiny_llama(path: str) -> None:
    """A Llama without a tokenizer in its folder: the trainer falls back to bytes."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def write_jsonl_dataset(path) -> None:
    """A JSON-lines dataset, one paragraph of the built-in Shakespeare per record."""
    with open(path, "w") as f:
        for paragraph in load_text()[:30_000].split("\n\n"):
            f.write(json.dumps({"text": paragraph}) + "\n")


def gpt_run_folder(out, **gpt) -> torch.nn.Module:
    """OUT/config.toml and OUT/checkpoints/step_000003 of a debug-preset GPT."""
    cfg = apply_overrides(get_preset("debug"), {f"gpt.{k}": v for k, v in gpt.items()},
                          "test")
    os.makedirs(out)
    with open(os.path.join(out, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    torch.manual_seed(0)
    model = build_model(cfg.gpt)
    with torch.no_grad():  # biases and norms away from their initial 0 and 1
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    checkpoint.save(os.path.join(out, "checkpoints", "step_000003"), model,
                    extra={"step": 3})
    return model
