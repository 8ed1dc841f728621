"""``FullyShardedDataParallel(module, ...)``: the FSDP1 arguments, served by ``fully_shard``.

Each unit the wrap policy selects (children first, the root last) is prepared the
way FSDP1 prepares it (materialized from the meta device, broadcast from rank 0,
buffers cast) and then sharded by ``fully_shard`` in place: parameter names stay the
model's own and every unit is both its original class and ``FullyShardedDataParallel``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..api import fsdp_class, fully_shard
from ..fsdp_module import FSDPModule
from ..core.init import managed_modules
from ..core.mesh import mesh_device_type
from ..policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..wrap import apply_wrap_policy
from .mesh import resolve_mesh
from .options import (BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy,
                      as_dataclass, as_enum)

WHERE = "FullyShardedDataParallel"


def shard_fsdp1(front: type, module: nn.Module, process_group=None, sharding_strategy=None,
                cpu_offload=None, auto_wrap_policy=None,
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE, mixed_precision=None,
                ignored_modules=None, param_init_fn=None, device_id=None,
                sync_module_states: bool = False, forward_prefetch: bool = False,
                limit_all_gathers: bool = True, use_orig_params: bool = False,
                ignored_states=None, device_mesh=None) -> nn.Module:
    """Shard ``module`` as FSDP1 would and return it with its class swapped to a
    subclass of ``front`` (``FullyShardedDataParallel``)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{WHERE}: expected an nn.Module, got {type(module).__name__}.")
    if isinstance(module, FSDPModule):
        raise ValueError(f"{WHERE}: {type(module).__name__} is already sharded; wrap each "
                         "module once (submodules first, then the root).")
    strategy = as_enum(sharding_strategy, ShardingStrategy, "sharding_strategy") \
        or ShardingStrategy.FULL_SHARD
    prefetch = as_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch")
    mixed = as_dataclass(mixed_precision, MixedPrecision, "mixed_precision")
    offload = as_dataclass(cpu_offload, CPUOffload, "cpu_offload")
    for name, value in (("sync_module_states", sync_module_states),
                        ("forward_prefetch", forward_prefetch),
                        ("limit_all_gathers", limit_all_gathers),
                        ("use_orig_params", use_orig_params)):
        if not isinstance(value, bool):
            raise TypeError(f"{WHERE}: {name} must be a bool, got {value!r}.")
    if auto_wrap_policy is not None and not callable(auto_wrap_policy):
        raise TypeError(f"{WHERE}: auto_wrap_policy must be callable as policy(module, recurse, "
                        f"nonwrapped_numel), e.g. from fullshard.wrap; got "
                        f"{type(auto_wrap_policy).__name__}.")
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"{WHERE}: param_init_fn must be a callable taking a module.")
    device = _compute_device(device_id)
    mesh = resolve_mesh(strategy, process_group, device_mesh, device.type)
    ignored_mods, ignored_params = _ignored(module, ignored_modules, ignored_states)
    unit_kwargs = dict(
        mesh=mesh,
        reshard_after_forward=strategy in (ShardingStrategy.FULL_SHARD,
                                           ShardingStrategy.HYBRID_SHARD),
        offload_policy=CPUOffloadPolicy() if offload is not None and offload.offload_params
        else OffloadPolicy(),
        ignored_params=ignored_params)
    keep_fp32 = _mixed_precision_checks(mixed)
    sync_group = mesh.get_group(0) if mesh.ndim == 1 else dist.group.WORLD

    def wrap(unit: nn.Module) -> None:
        _materialize(unit, ignored_mods, device, param_init_fn)
        if sync_module_states:
            _broadcast_from_rank0(unit, ignored_mods, sync_group)
        full_precision = keep_fp32 is not None and isinstance(unit, keep_fp32)
        if mixed is not None and mixed.buffer_dtype is not None and not full_precision:
            _cast_buffers(unit, ignored_mods, mixed.buffer_dtype)
        kwargs = unit_kwargs if unit is not module else {
            **unit_kwargs, "reshard_after_forward": None}  # FSDP1 never frees the root early
        fully_shard(unit, mp_policy=_unit_mp_policy(mixed, unit is module, full_precision),
                    **kwargs)
        if strategy is ShardingStrategy.ZERO1:
            unit.set_keep_unsharded_storage(True, recurse=False)
        unit.__class__ = fsdp_class(type(unit), front)
        _configure(unit, forward_prefetch, prefetch)

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if module in ignored_mods or isinstance(module, FSDPModule):
            return False
        if keep_fp32 is not None and isinstance(module, keep_fp32):
            return True
        if auto_wrap_policy is not None and auto_wrap_policy(
                module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel):
            return True
        return recurse and keep_fp32 is not None  # look for full-precision modules below

    apply_wrap_policy(module, policy, wrap)
    return module


def _compute_device(device_id: Any) -> torch.device:
    """The device units compute on; fullshard computes on the current device of its type."""
    default = torch.device(mesh_device_type()) if dist.is_initialized() else torch.device("cpu")
    if device_id is None:
        device = default
    elif isinstance(device_id, int):
        device = torch.device("cuda", device_id)
    elif isinstance(device_id, (torch.device, str)):
        device = torch.device(device_id)
    else:
        raise TypeError(f"{WHERE}: device_id must be an int or torch.device, got "
                        f"{type(device_id).__name__}.")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{WHERE}: device_id={device_id!r} names a CUDA device but CUDA "
                             "is not available; pass device_id=torch.device('cpu') or omit it.")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index != torch.cuda.current_device():
            raise ValueError(
                f"{WHERE}: device_id={device_id!r} is not the current CUDA device "
                f"(cuda:{torch.cuda.current_device()}); call torch.cuda.set_device({index}) "
                "before building the model: fullshard computes on the current device.")
        device = torch.device("cuda", index)
    if dist.is_initialized() and device.type != default.type:
        raise ValueError(f"{WHERE}: device_id={device_id!r} does not match the process "
                         f"group's backend {dist.get_backend()!r}, which runs on {default.type}.")
    return device


def _ignored(module: nn.Module, ignored_modules, ignored_states
             ) -> tuple[set[nn.Module], set[nn.Parameter]]:
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(f"{WHERE}: pass ignored_modules or ignored_states, not both.")
    items = list(ignored_modules or ignored_states or [])
    mods = {m for m in items if isinstance(m, nn.Module)}
    params = {p for p in items if isinstance(p, nn.Parameter)}
    for x in items:
        if not isinstance(x, (nn.Module, nn.Parameter)):
            raise TypeError(f"{WHERE}: ignored modules/states must be nn.Modules or "
                            f"nn.Parameters, got {type(x).__name__}.")
    if module in mods:
        raise ValueError(f"{WHERE}: the wrapped module itself cannot be ignored.")
    all_mods = {sub for m in mods for sub in m.modules()}
    params |= {p for m in mods for p in m.parameters()}
    return all_mods, params


def _mixed_precision_checks(mixed: MixedPrecision | None) -> tuple[type, ...] | None:
    """Validate ``mixed``; return the classes kept in full precision (or None)."""
    if mixed is None:
        return None
    if mixed.keep_low_precision_grads:
        raise ValueError(
            f"{WHERE}: MixedPrecision(keep_low_precision_grads=True) is not supported: "
            "fullshard reduces gradients in reduce_dtype and keeps .grad in the parameters' "
            "dtype, next to the optimizer states. Set reduce_dtype for low-precision "
            "communication.")
    classes = tuple(mixed._module_classes_to_ignore or ())
    return classes if classes and mixed.param_dtype is not None else None


def _unit_mp_policy(mixed: MixedPrecision | None, is_root: bool,
                    full_precision: bool) -> MixedPrecisionPolicy:
    if mixed is None:
        return MixedPrecisionPolicy()
    if full_precision:  # e.g. BatchNorm: inputs up to fp32, outputs back to param_dtype
        return MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=mixed.param_dtype,
                                    cast_forward_inputs=True)
    cast = mixed.cast_forward_inputs or (is_root and mixed.cast_root_forward_inputs)
    # FSDP1 reduces in param_dtype when reduce_dtype is None, on every torch (FSDP2's
    # default moved in 2.15: Note [torch versions]), so it is passed explicitly
    return MixedPrecisionPolicy(param_dtype=mixed.param_dtype,
                                reduce_dtype=mixed.reduce_dtype or mixed.param_dtype,
                                cast_forward_inputs=cast)


def _own_modules(unit: nn.Module, ignored: set[nn.Module]) -> list[nn.Module]:
    return [sub for _, sub in managed_modules(unit) if sub not in ignored]


def _materialize(unit: nn.Module, ignored: set[nn.Module], device: torch.device,
                 param_init_fn: Callable[[nn.Module], None] | None) -> None:
    """FSDP1's meta-device init: ``param_init_fn(m)`` for each module of the unit, or
    empty tensors on ``device`` (tied parameters stay tied) and ``reset_parameters()``."""
    modules = _own_modules(unit, ignored)
    if not any(t.is_meta for m in modules
               for t in [*m._parameters.values(), *m._buffers.values()] if t is not None):
        return
    if param_init_fn is not None:
        for m in modules:
            param_init_fn(m)
        return
    made: dict[int, torch.Tensor] = {}
    for m in modules:
        for table, as_param in ((m._parameters, True), (m._buffers, False)):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    empty = torch.empty_like(t, device=device)
                    made[id(t)] = nn.Parameter(empty, t.requires_grad) if as_param else empty
                table[name] = made[id(t)]
    with torch.no_grad():
        for m in modules:
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()


def _broadcast_from_rank0(unit: nn.Module, ignored: set[nn.Module],
                          group: dist.ProcessGroup) -> None:
    """``sync_module_states``: every rank starts from rank 0's parameters and buffers."""
    seen: set[int] = set()
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for m in _own_modules(unit, ignored):
            for t in [*m._parameters.values(), *m._buffers.values()]:
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if t.is_meta:
                    raise ValueError(
                        f"{WHERE}: sync_module_states=True with {type(m).__name__} still on the "
                        "meta device; pass param_init_fn (or build the module on a real device "
                        "on every rank) so there is memory to receive rank 0's values.")
                dist.broadcast(t.data, src=src, group=group)


def _cast_buffers(unit: nn.Module, ignored: set[nn.Module], dtype: torch.dtype) -> None:
    """``MixedPrecision.buffer_dtype``: buffers computed in ``dtype``; state dicts keep the
    original dtype (a post hook casts the saved values back)."""
    for m in _own_modules(unit, ignored):
        original: dict[str, torch.dtype] = {}
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                original[name] = buf.dtype
                m._buffers[name] = buf.to(dtype)
        if original:
            m.register_state_dict_post_hook(_restore_buffer_dtypes(original))


def _restore_buffer_dtypes(original: dict[str, torch.dtype]):
    def hook(module, state_dict, prefix, local_metadata) -> None:
        for name, dtype in original.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = state_dict[key].to(dtype)
    return hook


def _configure(unit: nn.Module, forward_prefetch: bool,
               backward_prefetch: BackwardPrefetch | None) -> None:
    state = unit._unit
    if not forward_prefetch:
        state.forward_prefetch = []  # FSDP1's default: gather each unit when it runs
    if backward_prefetch is None:
        state.backward_prefetch = []
    state.backward_prefetch_after_grads = backward_prefetch is BackwardPrefetch.BACKWARD_POST
