"""The option types of ``torch.distributed.fsdp.FullyShardedDataParallel``, same names and values.

fullshard's FSDP1 front also accepts torch's own enums and dataclasses for these
(matched by name), so code that imports them from torch keeps working.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch
import torch.nn as nn


class ShardingStrategy(enum.Enum):
    """What each rank holds between uses, and which collectives move it.

    FULL_SHARD: parameters, gradients and optimizer states sharded; parameters gathered
        for forward and again for backward (ZeRO-3).
    SHARD_GRAD_OP: as FULL_SHARD, but parameters stay gathered from forward to the end of
        backward (ZeRO-2): no all-gather in backward.
    NO_SHARD: every rank holds everything; gradients are all-reduced (DDP).
    HYBRID_SHARD: FULL_SHARD within each node, replicated across nodes (gradients
        reduce-scattered within the node, then all-reduced across nodes).
    _HYBRID_SHARD_ZERO2: HYBRID_SHARD with SHARD_GRAD_OP within the node.
    ZERO1 (fullshard's; torch's enum has no such member): SHARD_GRAD_OP whose gathered
        parameters stay on the device between steps and are re-gathered after each step;
        gradients and optimizer states sharded (Note [ZeRO-1 is ZeRO-2 keeping the
        gathered storage] in train/model.py).
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()
    ZERO1 = enum.auto()


class BackwardPrefetch(enum.Enum):
    """When backward starts gathering the next unit's parameters.

    BACKWARD_PRE: when the current unit's backward starts (most overlap, one more unit's
        parameters in memory).
    BACKWARD_POST: after the current unit's gradients are computed and its parameters
        freed (less overlap, lower peak). ``None`` as the argument: no prefetch.
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """What ``model.state_dict()`` returns inside ``FSDP.state_dict_type(model, ...)``."""

    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclass
class MixedPrecision:
    """Dtypes for compute, gradient reduction and buffers.

    Attributes:
        param_dtype: dtype parameters are gathered and computed in.
        reduce_dtype: dtype gradients are reduced in (default: ``param_dtype``).
        buffer_dtype: dtype buffers are cast to (checkpoints keep their original dtype).
        keep_low_precision_grads: keep ``.grad`` in low precision; fullshard keeps gradients
            in the parameters' dtype, so only ``False`` is accepted.
        cast_forward_inputs: cast floating-point inputs of every unit to ``param_dtype``.
        cast_root_forward_inputs: cast floating-point inputs of the root to ``param_dtype``.
        _module_classes_to_ignore: modules of these classes compute in full precision
            in a unit of their own (BatchNorm, whose statistics need it).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (nn.modules.batchnorm._BatchNorm,)


@dataclass
class CPUOffload:
    """``offload_params=True`` keeps sharded parameters, gradients and optimizer states on
    the CPU (see ``fullshard.CPUOffloadPolicy``)."""

    offload_params: bool = False


@dataclass
class StateDictConfig:
    """Base of the state-dict configs; ``offload_to_cpu`` moves values to the CPU."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """Full (unsharded) tensors; with ``rank0_only`` other ranks get an empty dict."""

    rank0_only: bool = False


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """DTensor shards (``_use_dtensor`` is accepted for torch compatibility: always DTensor)."""

    _use_dtensor: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class StateDictSettings:
    """What ``FSDP.get_state_dict_type(module)`` returns."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


def as_enum(value: Any, enum_cls: type[enum.Enum], argument: str) -> Any:
    """``value`` as fullshard's ``enum_cls``, accepting torch's enum of the same name."""
    if value is None or isinstance(value, enum_cls):
        return value
    if isinstance(value, enum.Enum) and value.name in enum_cls.__members__:
        return enum_cls[value.name]
    choices = ", ".join(f"{enum_cls.__name__}.{n}" for n in enum_cls.__members__)
    raise TypeError(f"FullyShardedDataParallel: {argument}={value!r} is not one of {choices}.")


def as_dataclass(value: Any, cls: type, argument: str) -> Any:
    """``value`` as fullshard's dataclass ``cls``, accepting torch's class of the same name
    (copied field by field)."""
    if value is None or isinstance(value, cls):
        return value
    if type(value).__name__ == cls.__name__:
        return cls(**{f.name: getattr(value, f.name) for f in fields(cls) if hasattr(value, f.name)})
    raise TypeError(f"FullyShardedDataParallel: {argument} must be a fullshard.{cls.__name__}, "
                    f"got {type(value).__name__}.")
