"""The models the estimator can build on the meta device, and how each computes a loss.

A ``Workload`` is a model builder plus the loss of one micro-batch: what the
activation trace runs. Sources: a ``GPTConfig``, a trainer preset name, a Hugging
Face config (a ``config.json`` path, a model directory, a dict or a
``PretrainedConfig``; ``transformers`` is imported only then), or an ``nn.Module``
already on the meta device (a GPT or a Hugging Face causal LM, or any module with
a ``loss_of`` function supplied).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import torch
import torch.nn as nn

from ..gpt import GPT, PRESET_SHAPES, GPTConfig, lm_loss

LossOf = Callable[[nn.Module, int, int], torch.Tensor]  # (model, batch, seq) -> loss

@dataclass(frozen=True)
class Workload:
    """A model to build on the meta device and the loss of one micro-batch."""

    name: str
    build: Callable[[], nn.Module]
    loss_of: LossOf
    max_seq_len: int | None  # the longest sequence the model accepts, if it says

    def seq_len_or(self, seq_len: int | None) -> int:
        if seq_len is not None:
            return seq_len
        if self.max_seq_len is None:
            raise ValueError(f"estimate({self.name}): pass seq_len (the model does not bound it)")
        return self.max_seq_len


def _gpt_loss(model: nn.Module, batch: int, seq: int) -> torch.Tensor:
    """The loss as trainers compute it (fullshard train, torchtitan): over logits cast to
    fp32. Under bf16/fp16 the cast copy, the fp32 softmax and their gradients are the
    largest tensors of a large-vocabulary step (without them the estimate of a bf16 run
    was 23% low on CPU); in fp32 the cast is a no-op."""
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return lm_loss(model(tokens).float(), tokens)


def _hf_loss(model: nn.Module, batch: int, seq: int) -> torch.Tensor:
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    # Recent transformers look for packed sequences in the position ids, a check that
    # reads values: meta tensors have none, and the estimate is of unpacked sequences.
    masking = sys.modules.get("transformers.masking_utils")
    with contextlib.ExitStack() as stack:
        if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
            stack.enter_context(mock.patch.object(masking, "find_packed_sequence_indices",
                                                  lambda *_a, **_k: None))
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def workload_for(source: Any, loss_of: LossOf | None = None) -> Workload:
    """A Workload for any supported source (see the module docstring)."""
    if isinstance(source, Workload):
        return source
    if isinstance(source, GPTConfig):
        return Workload(f"GPT d={source.d_model} L={source.n_layers}", lambda: _meta_gpt(source),
                        loss_of or _gpt_loss, source.seq_len)
    if isinstance(source, nn.Module):
        return _module_workload(source, loss_of)
    if isinstance(source, str) and not os.path.exists(source):
        return workload_for(preset(source), loss_of)
    return _hf_workload(source, loss_of)


def _meta_gpt(cfg: GPTConfig) -> nn.Module:
    with torch.device("meta"):
        return GPT(cfg)


def _module_workload(model: nn.Module, loss_of: LossOf | None) -> Workload:
    if any(not t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            f"estimate: {type(model).__name__} has tensors off the meta device; build it "
            "under `with torch.device('meta'):` so estimating allocates nothing.")
    if loss_of is None:
        if isinstance(model, GPT):
            loss_of = _gpt_loss
        elif hasattr(model, "config") and hasattr(model.config, "vocab_size"):
            loss_of = _hf_loss
        else:
            raise ValueError(
                f"estimate: no loss for {type(model).__name__}; pass loss_of=fn(model, "
                "batch, seq) returning the loss of one micro-batch built on the meta device.")
    max_seq = model.cfg.seq_len if isinstance(model, GPT) else _hf_max_positions(
        getattr(model, "config", None))
    return Workload(type(model).__name__, lambda: copy.deepcopy(model), loss_of, max_seq)


def preset(name: str) -> GPTConfig:
    """The model shape of the trainer's preset ``name`` (fullshard.gpt.PRESET_SHAPES)."""
    if name not in PRESET_SHAPES:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESET_SHAPES)} "
                         "(or pass a Hugging Face config.json path)")
    return PRESET_SHAPES[name]


def _import_transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("estimating a Hugging Face model needs `transformers`: "
                          "pip install transformers") from err
    return transformers


def hf_config(source: Any):
    """A ``PretrainedConfig`` from a config.json path, a model directory or a dict."""
    transformers = _import_transformers()
    if isinstance(source, transformers.PretrainedConfig):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            source = json.load(f)
    if not isinstance(source, dict) or "model_type" not in source:
        raise ValueError("estimate: a Hugging Face config needs a 'model_type' field")
    fields = dict(source)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def _hf_max_positions(config: Any) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def _hf_workload(source: Any, loss_of: LossOf | None) -> Workload:
    config = hf_config(source)
    config._attn_implementation = "sdpa"

    def build() -> nn.Module:
        transformers = _import_transformers()
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)

    return Workload(f"{config.model_type} ({type(config).__name__})", build,
                    loss_of or _hf_loss, _hf_max_positions(config))
