"""FSDP1 state-dict types over fullshard's DTensor parameters.

A sharded model's ``state_dict()`` natively holds DTensor shards (SHARDED_STATE_DICT).
FSDP1 returns full tensors by default (FULL_STATE_DICT), so the FSDP1 front converts
at the outermost ``state_dict()``/``load_state_dict()`` call according to the settings
``FSDP.state_dict_type(model, ...)`` put on the model's units. Inner calls (the
module tree's own recursion) and fullshard's checkpoint functions, which run inside
``core.features.native_state_dict.native_state_dict()``, see the DTensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..checkpoint import StateDictOptions
from .options import (FullOptimStateDictConfig, FullStateDictConfig, OptimStateDictConfig,
                      ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictSettings,
                      StateDictType, as_dataclass, as_enum)

_DEFAULT_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


_SETTINGS_KEY = "_fullshard_state_dict_settings"  # read and written only below


def settings_of(unit: nn.Module) -> StateDictSettings:
    """The state-dict type an FSDP unit uses (FSDP.state_dict_type sets it; default full)."""
    return unit.__dict__.get(_SETTINGS_KEY) or StateDictSettings(
        StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


def set_settings(unit: nn.Module, settings: StateDictSettings) -> None:
    unit.__dict__[_SETTINGS_KEY] = settings


def make_settings(state_dict_type, state_dict_config, optim_state_dict_config
                  ) -> StateDictSettings:
    kind = as_enum(state_dict_type, StateDictType, "state_dict_type")
    if kind is StateDictType.LOCAL_STATE_DICT:
        raise ValueError(
            "FSDP.state_dict_type: LOCAL_STATE_DICT is not supported by fullshard; use "
            "SHARDED_STATE_DICT, whose DTensor values hold exactly this rank's shard "
            "(value.to_local()) and load back at any world size.")
    config_cls, optim_cls = _DEFAULT_CONFIGS[kind]
    config = as_dataclass(state_dict_config, config_cls, "state_dict_config") or config_cls()
    optim_config = as_dataclass(optim_state_dict_config, optim_cls,
                                "optim_state_dict_config") or optim_cls()
    return StateDictSettings(kind, config, optim_config)


def full_state_dict(state_dict: dict[str, Any], config: FullStateDictConfig, prefix: str
                    ) -> dict[str, Any]:
    """Replace DTensor values under ``prefix`` by full tensors (gathered one at a time, in
    the same key order on every rank); with ``rank0_only`` other ranks keep nothing."""
    keep = not config.rank0_only or dist.get_rank() == 0
    for key in list(state_dict):
        if not key.startswith(prefix):
            continue
        value = state_dict[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if config.offload_to_cpu:
                value = value.cpu()
        if keep:
            state_dict[key] = value
        else:
            del state_dict[key]
    return state_dict


def shard_full_values(module: nn.Module, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` whose plain tensors for DTensor parameters are replaced by
    this rank's shards (no communication: every rank holds the full values)."""
    targets = {name: p for name, p in module.named_parameters(remove_duplicate=False)
               if isinstance(p, DTensor)}
    out = dict(state_dict)
    for name, value in state_dict.items():
        target = targets.get(name)
        if target is None or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
            continue
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"load_state_dict: '{name}' has shape {tuple(value.shape)} in the "
                             f"state dict but {tuple(target.shape)} in the model.")
        out[name] = local_shard(value, target)
    return out


def local_shard(full: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's shard of ``full`` laid out as ``like`` (same mesh, placements, device
    and dtype); no communication: every rank holds ``full``."""
    local = full.detach().to(device=like.to_local().device, dtype=like.dtype)
    return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)


def optim_options(settings: StateDictSettings, loading: bool):
    """fullshard.checkpoint's StateDictOptions for the optimizer under ``settings``."""
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    config: OptimStateDictConfig = settings.optim_state_dict_config
    rank0_only = full and getattr(config, "rank0_only", False)
    # torch's full + cpu_offload keeps values on rank 0 only: exactly rank0_only with offload
    return StateDictOptions(full_state_dict=full,
                            cpu_offload=bool(rank0_only and config.offload_to_cpu and not loading))

