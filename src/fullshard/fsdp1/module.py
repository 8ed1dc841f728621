"""``FullyShardedDataParallel``: the FSDP1 wrapper API, served by ``fully_shard``.

``FSDP(model, ...)`` shards ``model`` in place and returns it: the result is the same
object, an instance of both its own class and ``FullyShardedDataParallel`` (and of
``FSDPModule``), with the model's own parameter names (no ``_fsdp_wrapped_module.``
prefixes). The static methods of torch's class (``state_dict_type``,
``summon_full_params``, ``optim_state_dict``, ...) take such models.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ..fsdp_module import FSDPModule
from .. import grad_norm
from ..checkpoint import (StateDictOptions, get_optimizer_state_dict,
                          set_optimizer_state_dict)
from ..core.features.native_state_dict import is_outermost, native_state_dict
from . import full_params
from . import state_dict as sd
from .construct import shard_fsdp1
from .options import StateDictSettings, StateDictType


class FullyShardedDataParallel(FSDPModule):
    """Shard ``module`` with the arguments of ``torch.distributed.fsdp.FullyShardedDataParallel``.

    Args:
        module: the model (or submodule) to shard; returned, sharded in place.
        process_group: the ranks to shard over (default: all).
        sharding_strategy: ``ShardingStrategy`` (default ``FULL_SHARD``).
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps shards, gradients and
            optimizer states in CPU memory.
        auto_wrap_policy: which submodules become units (``fullshard.wrap`` policies or any
            ``policy(module, recurse, nonwrapped_numel)``).
        backward_prefetch: ``BACKWARD_PRE`` (default), ``BACKWARD_POST`` or ``None``.
        mixed_precision: ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype, ...)``.
        ignored_modules / ignored_states: modules or parameters left unsharded and unreduced.
        param_init_fn: called on each module of a unit still on the meta device (default:
            empty tensors on the device, then ``reset_parameters()``).
        device_id: the compute device; must be the current device (CPU with gloo).
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        forward_prefetch: gather the next unit while the current one computes in forward
            (default ``False``, as torch: each unit is gathered when it runs).
        limit_all_gathers: accepted for compatibility; fullshard never has more than one
            prefetched gather in flight, which is what the limit guarantees.
        use_orig_params: accepted for compatibility; fullshard always exposes the original
            parameters (as sharded DTensors), which is what ``True`` means.
        device_mesh: a 1-D mesh, or a 2-D (replicate, shard) mesh for the hybrid strategies.
    """

    def __new__(cls, *args, **kwargs):
        if cls is not FullyShardedDataParallel:  # a sharded module's class being rebuilt
            return FSDPModule.__new__(cls, *args, **kwargs)
        return shard_fsdp1(FullyShardedDataParallel, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        """The work happened in ``__new__``, which returns the sharded module itself."""

    @property
    def module(self) -> nn.Module:
        """The wrapped module: the module itself, since fullshard wraps in place (a child
        registered as ``module`` is returned instead, so the model's own code still works)."""
        return self._modules.get("module", self)

    # -- state dicts ----------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        if not is_outermost():
            return super().state_dict(*args, **kwargs)
        with native_state_dict():
            result = super().state_dict(*args, **kwargs)
        settings = sd.settings_of(self)
        if settings.state_dict_type is StateDictType.FULL_STATE_DICT:
            prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
            return sd.full_state_dict(result, settings.state_dict_config, prefix)
        if settings.state_dict_config.offload_to_cpu:
            return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in result.items()}
        return result

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if not is_outermost():
            return super().load_state_dict(state_dict, strict, assign)
        for m in self.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        if sd.settings_of(self).state_dict_type is StateDictType.FULL_STATE_DICT:
            state_dict = sd.shard_full_values(self, state_dict)
        with native_state_dict():
            return super().load_state_dict(state_dict, strict, assign)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None) -> Iterator[None]:
        """Within the block, ``module.state_dict()``/``load_state_dict()`` and
        ``FSDP.optim_state_dict`` use ``state_dict_type`` (FULL_STATE_DICT or
        SHARDED_STATE_DICT)."""
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module, previous.state_dict_type, previous.state_dict_config,
                previous.optim_state_dict_config)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type, state_dict_config=None,
                            optim_state_dict_config=None) -> StateDictSettings:
        """Set the state-dict type of every unit under ``module``; return the previous one."""
        previous = FullyShardedDataParallel.get_state_dict_type(module)
        settings = sd.make_settings(state_dict_type, state_dict_config, optim_state_dict_config)
        for unit in FullyShardedDataParallel.fsdp_modules(module):
            sd.set_settings(unit, settings)
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not units:
            raise ValueError(f"FSDP.get_state_dict_type: {type(module).__name__} contains no "
                             "FullyShardedDataParallel module.")
        return sd.settings_of(units[0])

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None,
                         group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name: full tensors or DTensor shards
        according to ``model``'s state-dict type."""

        options = sd.optim_options(FullyShardedDataParallel.get_state_dict_type(model),
                                   loading=False)
        return get_optimizer_state_dict(model, optim, options=options)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: dict[str, Any], is_named_optimizer: bool = False,
                                 load_directly: bool = False,
                                 group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """Load ``optim_state_dict`` (from ``optim_state_dict``) into ``optim`` and return the
        optimizer's own state dict, so ``optim.load_state_dict(result)`` works as with torch."""

        options = sd.optim_options(FullyShardedDataParallel.get_state_dict_type(model),
                                   loading=True)
        set_optimizer_state_dict(model, optim, optim_state_dict, options=options)
        return optim.state_dict()

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input=None,
                              rank0_only: bool = True, group=None) -> dict[str, Any]:
        """torch's older spelling: the full optimizer state keyed by name, on rank 0 only
        (on the CPU) when ``rank0_only``."""

        _no_optim_input("full_optim_state_dict", optim_input)
        return get_optimizer_state_dict(model, optim, options=StateDictOptions(
            full_state_dict=True, cpu_offload=rank0_only))

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                 group=None) -> dict[str, Any]:
        """torch's older spelling: the optimizer state as DTensor shards keyed by name."""

        return get_optimizer_state_dict(model, optim)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict, model, *args, **kwargs):
        raise NotImplementedError(_NEEDS_OPTIMIZER.format("shard_full_optim_state_dict"))

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict, model, *args, **kwargs):
        raise NotImplementedError(_NEEDS_OPTIMIZER.format("scatter_full_optim_state_dict"))

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim):
        raise NotImplementedError(_NEEDS_OPTIMIZER.format("flatten_sharded_optim_state_dict"))

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, *args, **kwargs):
        raise NotImplementedError(
            "FSDP.rekey_optim_state_dict: fullshard's optimizer state dicts are always keyed "
            "by parameter name (FSDP.optim_state_dict) and loaded with "
            "FSDP.optim_state_dict_to_load, which needs no re-keying.")

    def register_comm_hook(self, state, hook) -> None:
        raise NotImplementedError(
            "FSDP.register_comm_hook: fullshard does not take communication hooks; for "
            "low-precision reduction use MixedPrecision(reduce_dtype=...).")

    # -- other torch FSDP1 methods --------------------------------------------------------
    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False,
                           with_grads: bool = False):
        """Context manager: the full parameters are registered on ``module`` inside; with
        ``writeback`` changes to them are written back to the shards on exit."""
        return full_params.summon_full_params(module, recurse, writeback, rank0_only,
                                              offload_to_cpu, with_grads)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their norm over all ranks; return the norm before clipping."""
        return grad_norm.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        """The FullyShardedDataParallel modules under ``module`` (itself included)."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if root_only:
            inner = {id(sub) for u in units for sub in u.modules() if sub is not u}
            units = [u for u in units if id(u) not in inner]
        return units

    def check_is_root(self) -> bool:
        unit = self._unit
        return unit.root is None or unit.is_root


_NEEDS_OPTIMIZER = (
    "FSDP.{}: fullshard loads optimizer state with the optimizer at hand; use "
    "FSDP.optim_state_dict_to_load(model, optim, optim_state_dict), then "
    "optim.load_state_dict(result).")


def _no_optim_input(method: str, optim_input) -> None:
    if optim_input is not None:
        raise ValueError(f"FSDP.{method}: optim_input is not supported (deprecated in torch); "
                         "pass the optimizer itself.")


FSDP = FullyShardedDataParallel

