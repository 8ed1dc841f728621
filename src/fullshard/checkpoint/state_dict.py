"""Model and optimizer state dicts of fullshard models, full or sharded.

The functions have the semantics of ``torch.distributed.checkpoint.state_dict`` and
delegate to it: fullshard's parameters are DTensors sharded on dim 0, which is what
those functions are written for. Sharded state dicts hold DTensors and cost no
communication; full ones gather one tensor at a time, so ranks other than 0 never
hold more than one unsharded tensor, and with ``cpu_offload`` only rank 0 keeps the
gathered tensors, on the CPU. Optimizer state is keyed by parameter FQN.
``broadcast_from_rank0`` loads a full state dict held only by rank 0 into a sharded
model, including one still on the meta device. Models built with
``FullyShardedDataParallel`` are handled the same way whatever their FSDP1
state-dict type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as _dsd

from ..fsdp1.state_dict import native_state_dict


@dataclass(frozen=True)
class StateDictOptions:
    """How a state dict is produced or consumed.

    Attributes:
        full_state_dict: unsharded tensors (gathered one at a time) instead of DTensors.
        cpu_offload: move values to the CPU; with ``full_state_dict`` only rank 0 keeps them.
        broadcast_from_rank0: when loading a full state dict, only rank 0 holds values;
            they are broadcast one tensor at a time and each rank keeps its shard.
        strict: loading fails on missing or unexpected keys.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    broadcast_from_rank0: bool = False
    strict: bool = True

    def to_torch(self) -> _dsd.StateDictOptions:
        return _dsd.StateDictOptions(full_state_dict=self.full_state_dict,
                                     cpu_offload=self.cpu_offload,
                                     broadcast_from_rank0=self.broadcast_from_rank0,
                                     strict=self.strict)


def _opts(options: StateDictOptions | None) -> _dsd.StateDictOptions:
    if options is None:
        return StateDictOptions().to_torch()
    if not isinstance(options, StateDictOptions):
        raise TypeError("options must be a fullshard.checkpoint.StateDictOptions, got "
                        f"{type(options).__name__}")
    return options.to_torch()


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None
                         ) -> dict[str, Any]:
    """The model's parameters and buffers by FQN (DTensors unless ``full_state_dict``)."""
    with native_state_dict():
        return _dsd.get_model_state_dict(model, options=_opts(options))


def set_model_state_dict(model: nn.Module, state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None):
    """Load ``state_dict`` (full or sharded) into the sharded ``model``; returns the
    missing and unexpected keys like ``nn.Module.load_state_dict``."""
    with native_state_dict():
        return _dsd.set_model_state_dict(model, state_dict, options=_opts(options))


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQN (states as DTensors unless full)."""
    with native_state_dict():
        return _dsd.get_optimizer_state_dict(model, optimizer, options=_opts(options))


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                             state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """Load an FQN-keyed optimizer state dict (full or sharded) into ``optimizer``."""
    with native_state_dict():
        _dsd.set_optimizer_state_dict(model, optimizer, state_dict, options=_opts(options))
