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

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as _dsd
from torch.distributed.tensor import DTensor

from ..core.guard.arrival import every_rank_arrives
from ..core.features.native_state_dict import native_state_dict


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


def _opts(options) -> _dsd.StateDictOptions:
    """fullshard's or torch's StateDictOptions (or None) as torch's."""
    if options is None:
        return StateDictOptions().to_torch()
    if isinstance(options, _dsd.StateDictOptions):
        return options
    if not isinstance(options, StateDictOptions):
        raise TypeError("options must be a StateDictOptions (fullshard.checkpoint's or "
                        "torch.distributed.checkpoint.state_dict's), got "
                        f"{type(options).__name__}")
    return options.to_torch()


def _check_in(call: str, model: nn.Module, options) -> None:
    """Full and broadcast state dicts gather or broadcast over every rank of the model's
    mesh: check that all of them called (Note [every rank arrives]). Checked where the
    mesh spans the job; a mesh over some ranks has no group here that holds exactly them."""
    opts = _opts(options)
    if not (opts.full_state_dict or opts.broadcast_from_rank0) or not dist.is_initialized():
        return
    sharded = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if sharded is not None and sharded.device_mesh.size() == dist.get_world_size():
        every_rank_arrives(f"{call} (full_state_dict="
                           f"{opts.full_state_dict}, broadcast_from_rank0="
                           f"{opts.broadcast_from_rank0})")


# The functions below have torch.distributed.checkpoint.state_dict's signatures, keyword
# names included (model_state_dict=, optim_state_dict=, optimizers=, submodules=).
def get_model_state_dict(model: nn.Module, *, submodules=None, options=None
                         ) -> dict[str, Any]:
    """The model's parameters and buffers by FQN (DTensors unless ``full_state_dict``)."""
    _check_in("get_model_state_dict", model, options)
    with native_state_dict():
        return _dsd.get_model_state_dict(model, submodules=submodules, options=_opts(options))


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *, options=None):
    """Load ``model_state_dict`` (full or sharded) into the sharded ``model``; returns the
    missing and unexpected keys like ``nn.Module.load_state_dict``."""
    _check_in("set_model_state_dict", model, options)
    with native_state_dict(), _quiet_about_the_default_device():
        return _dsd.set_model_state_dict(model, model_state_dict, options=_opts(options))


# What torch's DCP says when every value a rank holds is on the meta device (a model
# built there to receive rank 0's weights, broadcast_from_rank0): it asks the process
# group for a default device through a function it deprecates itself, which then warns
# that the group has several backends (gloo registers for CPU and CUDA). torch offers no
# argument to name the device; the broadcast works either way. Only these two messages,
# only around this call.
_DEFAULT_DEVICE_WARNINGS = (r"`_get_pg_default_device` will be deprecated",
                            r"Multiple backends are registered with this ProcessGroup")


@contextlib.contextmanager
def _quiet_about_the_default_device():
    with warnings.catch_warnings():
        for message in _DEFAULT_DEVICE_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def get_optimizer_state_dict(model: nn.Module, optimizers, *, submodules=None, options=None
                             ) -> dict[str, Any]:
    """The state of ``optimizers`` (one or several) keyed by parameter FQN (states as
    DTensors unless full)."""
    _check_in("get_optimizer_state_dict", model, options)
    with native_state_dict():
        return _dsd.get_optimizer_state_dict(model, optimizers, submodules=submodules,
                                             options=_opts(options))


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict: dict[str, Any], *,
                             options=None) -> None:
    """Load an FQN-keyed optimizer state dict (full or sharded) into ``optimizers``."""
    _check_in("set_optimizer_state_dict", model, options)
    with native_state_dict():
        _dsd.set_optimizer_state_dict(model, optimizers, optim_state_dict,
                                      options=_opts(options))


def get_state_dict(model: nn.Module, optimizers, *, submodules=None, options=None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``."""
    _check_in("get_state_dict", model, options)
    with native_state_dict():
        return _dsd.get_state_dict(model, optimizers, submodules=submodules,
                                   options=_opts(options))


def set_state_dict(model: nn.Module, optimizers, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options=None):
    """Load both state dicts; returns the model's missing and unexpected keys."""
    _check_in("set_state_dict", model, options)
    with native_state_dict():
        return _dsd.set_state_dict(model, optimizers, model_state_dict=model_state_dict,
                                   optim_state_dict=optim_state_dict, options=_opts(options))
