"""LoRA adapters (peft) on a Hugging Face model, over frozen base weights that may be
quantized to NF4 (torchao): QLoRA. The NF4 weights gather in NF4 (Note [tensor-subclass
parameters] in core/features/subclass_params.py); the optimizer sees the adapters only.

Every rank builds the same model: it reads the folder, seeds, and lets peft add the
adapters (peft initializes A at random, B at zero); nothing is broadcast.
"""

from __future__ import annotations

import torch.nn as nn

from .config.schema import LoraConfig
from .config.packages import import_optional

# NF4 quantizes blocks of values (one int8 scaler each) and the scalers in blocks of
# their own (one fp32 factor each); torchao's defaults, tried first.
NF4_BLOCKS = (64, 32, 16)
NF4_SCALER_BLOCKS = (256, 128, 64, 32, 16, 8, 4, 2, 1)


def add_lora(model: nn.Module, lora: LoraConfig, shard_size: int) -> nn.Module:
    """``model`` wrapped by peft with adapters of ``lora.rank`` on every linear layer but
    the output layer; the base weights frozen (quantized to NF4 with ``base="nf4"``)."""
    peft = import_optional("lora.rank")
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    if lora.base == "nf4":
        quantize_bases(model, shard_size)
    return model


def quantize_bases(model: nn.Module, shard_size: int) -> None:
    """Replace each adapted layer's base weight by its NF4 form (frozen)."""
    to_nf4 = import_optional("lora.base").quantization.to_nf4
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Linear) or not hasattr(module, "lora_A"):
            continue
        weight = base.weight.detach().float()
        block, scaler_block = nf4_block_sizes(weight.numel(), shard_size)
        base.weight = nn.Parameter(to_nf4(weight, block, scaler_block), requires_grad=False)


def nf4_block_sizes(numel: int, shard_size: int) -> tuple[int, int]:
    """The largest NF4 block sizes that split evenly into ``shard_size`` shards (each
    shard whole blocks of values and of scalers); torchao's defaults when they do. A
    weight with none gets the sizes that fit it whole, and fails at ``fully_shard``
    naming it (E107) rather than inside torchao."""
    for block in NF4_BLOCKS:
        if numel % (block * shard_size):
            continue
        scalers = numel // block
        for scaler_block in NF4_SCALER_BLOCKS:
            if scalers % (scaler_block * shard_size) == 0:
                return block, scaler_block
    if shard_size > 1:
        return nf4_block_sizes(numel, 1)
    return NF4_BLOCKS[0], NF4_SCALER_BLOCKS[0]
