"""Quantized weights and LoRA adapters, as the estimator models them.

Note [quantized weights in the estimate]
Three things change when the weights of a model's blocks are quantized or adapted,
and the estimator models each the way fullshard runs it:

* Bytes per element. torchao's NF4 (QLoRA's base weights) stores 4-bit codes, an
  int8 scaler per block of 64 values and an fp32 factor per 256 scalers: 0.516 bytes
  per weight, sharded and gathered (its ``fsdp_pre_all_gather`` sends those three
  tensors, and the unsharded weight views the gathered ones). A float8 training weight
  (torchao's ``Float8Linear`` with ``enable_fsdp_float8_all_gather``) keeps its shard,
  gradient and optimizer states in the parameter dtype and gathers one byte per weight.
  Both are tensor-subclass parameters, gathered beside the unit's flat buffer through
  one byte all-gather (Note [tensor-subclass parameters] in core/features/subclass_params.py);
  their units are never merged into buckets.
* What trains. LoRA (peft's ``target_modules="all-linear"``, as ``fullshard train
  --lora.rank`` adds it) puts adapters A (rank x in) and B (out x rank) beside every
  linear layer of the blocks and freezes every other weight: the frozen ones keep
  their shards and gathers but have no gradients and no optimizer states.
* Activations. The trace runs stand-ins with the real modules' autograd behaviour:
  an adapted linear computes ``base(x) + B(A(x)) * scale`` as peft does, and an NF4
  base dequantizes its weight for each matmul, forward and backward (torchao's
  ``linear_nf4``), with the temporaries torchao's ``get_original_weight`` holds at
  once: two int64 index halves, four half-size values in the dtype the weight was
  quantized from, the stacked result, then its copy in the compute dtype. For a
  weight quantized from fp32 that is 20 bytes per element at its peak (a 70B Llama's
  8192 x 28672 projection: 4.4 GiB for an instant). Float8 matmuls are traced
  in the compute dtype: torchao saves float8 copies of their inputs, so the traced
  activations of a float8 run are an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

QUANTIZE = ("nf4", "float8")
# torchao's NF4 defaults: 4-bit codes, an int8 scaler per 64 values, an fp32 factor per
# 256 scalers (train/lora.py picks smaller blocks only where a shard would split one).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
FLOAT8_BYTES = 1.0


@dataclass(frozen=True)
class WeightBytes:
    """Bytes per element of a tensor-subclass parameter; ``None``: the parameter dtype."""

    shard: float | None
    gathered: float


def check_weights(quantize: str | None, lora_rank: int, strategy: str,
                  reshard_after_forward: bool | int | None, world_size: int) -> None:
    """The combinations fullshard runs, or a one-line error naming the option."""
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"estimate: quantize={quantize!r} is not one of {QUANTIZE} (or None)")
    if lora_rank < 0:
        raise ValueError(f"estimate: lora_rank={lora_rank} is negative; give 0 (no adapters) "
                         "or the adapters' rank")
    if quantize == "nf4" and not lora_rank:
        raise ValueError("estimate: quantize='nf4' freezes the weights it quantizes, so "
                         "nothing would train; give lora_rank > 0 (QLoRA)")
    if quantize == "float8" and lora_rank:
        raise ValueError("estimate: quantize='float8' trains the weights it casts and "
                         "lora_rank freezes them; choose one of the two")
    if quantize is None:
        return
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"estimate: reshard_after_forward={reshard_after_forward} (hpZ) is "
                         f"not run for quantized ({quantize}) weights; give True or False")
    if strategy == "no_shard" and reshard_after_forward is None and world_size > 1:
        raise ValueError(f"estimate: strategy 'no_shard' shards on a 2-D mesh, which "
                         f"quantized ({quantize}) weights do not run on; use full_shard or "
                         "shard_grad_op")


def adapt_weights(model: nn.Module, units: list[nn.Module], quantize: str | None,
                  lora_rank: int) -> dict[int, WeightBytes]:
    """Quantize or adapt the linear layers of ``units`` but the root (the blocks), in
    place, as Note [quantized weights in the estimate] says; the bytes of each
    tensor-subclass parameter, by ``id``."""
    if quantize is None and not lora_rank:
        return {}
    linears = [(parent, name, child) for unit in units[:-1]
               for parent in unit.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    if not linears:
        raise ValueError("estimate: quantize/lora_rank apply to the linear layers of the "
                         "model's blocks, and its blocks have none")
    formats: dict[int, WeightBytes] = {}
    if lora_rank:
        for p in model.parameters():
            p.requires_grad_(False)
    for parent, name, linear in linears:
        if quantize == "float8":
            formats[id(linear.weight)] = WeightBytes(shard=None, gathered=FLOAT8_BYTES)
            continue
        adapted = _AdaptedLinear(linear, lora_rank,
                                 quantized_from=linear.weight.dtype if quantize == "nf4"
                                 else None)
        setattr(parent, name, adapted)
        if quantize == "nf4":
            formats[id(linear.weight)] = WeightBytes(shard=NF4_BYTES, gathered=NF4_BYTES)
    return formats


class _AdaptedLinear(nn.Module):
    """A linear layer with LoRA adapters beside it, as peft runs one (dropout 0)."""

    def __init__(self, base: nn.Linear, rank: int, quantized_from: torch.dtype | None):
        super().__init__()
        self.base_layer = base
        self.quantized_from = quantized_from  # NF4: the dtype its values were quantized from
        kw = {"device": base.weight.device, "dtype": base.weight.dtype, "bias": False}
        self.lora_A = nn.Linear(base.in_features, rank, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, **kw)
        self.scaling = 1.0 / math.sqrt(rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        y = base(x) if self.quantized_from is None \
            else _DequantizingLinear.apply(x, base.weight, base.bias, self.quantized_from)
        return y + self.lora_B(self.lora_A(x)) * self.scaling


class _DequantizingLinear(torch.autograd.Function):
    """torchao's ``linear_nf4``: the frozen weight is saved as it is and dequantized to
    the input's dtype for each matmul."""

    @staticmethod
    def forward(ctx, x, weight, bias, quantized_from):
        ctx.save_for_backward(weight)
        ctx.quantized_from = quantized_from
        return F.linear(x, _dequantized(weight, quantized_from, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ _dequantized(weight, ctx.quantized_from, grad.dtype), None, None, None


def _dequantized(weight: torch.Tensor, quantized_from: torch.dtype,
                 dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``weight``'s shape in ``dtype``, allocated through the temporaries
    torchao's NF4 dequantization holds at once (Note [quantized weights in the estimate])."""
    half = weight.numel() // 2
    held = [weight.new_empty(half, dtype=torch.long) for _ in range(2)]
    held += [weight.new_empty(half, dtype=quantized_from) for _ in range(4)]
    values = weight.new_empty(weight.shape, dtype=quantized_from)
    del held
    return values if dtype == quantized_from else values.to(dtype)
