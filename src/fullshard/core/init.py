"""From ``fully_shard``'s arguments to units, and from the first forward to a root.

Shard time (``shard_modules``): the arguments are checked, each parameter the unit
manages becomes a ShardedParam (core/param.py), the unit's parameters one ParamGroup
(core/group.py) that shards them now, and each module gets its UnitState
(core/state.py). The front (api.py, fsdp1/) then swaps the module's class and
installs the hooks.

First forward (``lazy_init``): the unit that runs first becomes the root of every
unit below it, small adjacent units are gathered in batches (core/buckets.py),
and the RootState that holds the iteration's bookkeeping is created.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..policies import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, as_mp_policy,
                        as_offload_policy)
from .guard import arrival, divergence
from .buckets import merge_small_units
from .features.grad_dtype import follow as follow_grad_dtypes
from .group import GroupState, ParamGroup, outside_special_modes
from .mesh import check_units_fit_root, data_parallel_mesh, mesh_device, resolve_mesh
from .refusals.torch_errors import FullyShardArgumentError, torch_first
from .param import SHARDED_ORIGINALS, ParamRef, ShardedParam, is_sharded_param
from .schedule import after_forward_rule
from .features.subclass_params import (check_subclass_param, check_subclass_unit,
                                       has_all_gather_hooks)
from .state import RootState, UnitState, attach_unit, unit_of
from .features.spmd_mesh import SpmdDims
from .features.tensor_parallel import is_foreign_dtensor, refuse_unrelated_tp_mesh
from .refusals.torch_fsdp import refuse_param_of_torch_fsdp2, refuse_torch_fsdp2


def shard_modules(modules: list[nn.Module], label: str, *, mesh: DeviceMesh | None,
                  reshard_after_forward: bool | int | None, shard_placement_fn: Callable | None,
                  mp_policy, offload_policy, ignored_params: set[nn.Parameter] | None,
                  dp_mesh_dims, debug: bool) -> list[UnitState]:
    """Shard ``modules`` as one unit (one group; ``fully_shard``'s arguments as given,
    torch's policy objects accepted): one UnitState per module, attached to it."""
    mp_policy, offload_policy = _check_arguments(label, mp_policy, offload_policy)
    if not isinstance(debug, bool):
        raise TypeError(f"fully_shard({label}): debug must be a bool, got {debug!r}.")
    for m in modules:
        _check_shardable(label, m)
        refuse_torch_fsdp2(label, m)
    spmd = data_parallel_mesh(label, mesh, dp_mesh_dims)
    if spmd is not None and type(reshard_after_forward) is int:
        # torch's words first: callers match them (docs/errors.md E337)
        raise NotImplementedError(torch_first(
            "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)",
            f"fully_shard({label}): reshard_after_forward={reshard_after_forward} with "
            "dp_mesh_dims; pass True or False."))
    mesh = resolve_mesh(label, spmd.dp_mesh if spmd else mesh)
    arrival.prepare(spmd.mesh if spmd else mesh)  # Note [every rank arrives]
    divergence.prepare(mesh)  # Note [ranks agree on every collective]
    pg = mesh.get_group(mesh.ndim - 1)  # the shard dimension is the last one
    replicate_pg = mesh.get_group(0) if mesh.ndim == 2 else None
    _check_reshard_after_forward(label, reshard_after_forward, pg.size())
    reshard_after_forward, post_forward_size = after_forward_rule(reshard_after_forward,
                                                                  pg.size())
    device = mesh_device(mesh)
    _check_compute_dtype(label, mp_policy.param_dtype, device)
    refs_by_module = [_collect_params(m, label, ignored_params or set(), mesh, spmd)
                      for m in modules]
    refs_by_param: dict[nn.Parameter, list[ParamRef]] = {}
    for refs in refs_by_module:
        for p, where in refs.items():
            refs_by_param.setdefault(p, []).extend(where)
    shard_dims = _shard_dims(label, shard_placement_fn, refs_by_param)
    group = None
    sharded: dict[nn.Parameter, ShardedParam] = {}
    if refs_by_param:
        kept = _kept_in_own_dtype(label, mp_policy, refs_by_param)
        for p, refs in refs_by_param.items():
            if p in kept:
                check_subclass_unit(label, refs[0].fqn, post_forward=post_forward_size is not None,
                                    tensor_parallel=isinstance(p, DTensor), mesh_ndim=mesh.ndim,
                                    how="is kept in its own dtype by param_dtype_override_fn")
            elif has_all_gather_hooks(p.to_local() if isinstance(p, DTensor) else p):
                check_subclass_unit(label, refs[0].fqn, post_forward=post_forward_size is not None,
                                    tensor_parallel=isinstance(p, DTensor), mesh_ndim=mesh.ndim)
        sharded = {p: ShardedParam(refs, p, mesh, pg.rank(), pg.size(), label, spmd,
                                   shard_dims.get(p, 0), keep_dtype=p in kept)
                   for p, refs in refs_by_param.items()}
        _check_tensor_parallel(label, sharded.values(), post_forward_size)
        offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
        flat_dtype = next((p.dtype for p, sp in sharded.items() if sp.extension is None),
                          next(iter(refs_by_param)).dtype)
        reduce_dtype = mp_policy.reduce_dtype_for(flat_dtype)
        if kept and mp_policy.reduce_dtype is None:  # gradients of both dtypes: the wider
            reduce_dtype = torch.promote_types(mp_policy.param_dtype,
                                               next(iter(kept)).dtype)
        group = ParamGroup(list(sharded.values()), pg, label, mp_policy.param_dtype,
                           reduce_dtype, replicate_pg,
                           post_forward_size, offload=offload, mesh=mesh, mp_policy=mp_policy)
        group.shard(list(refs_by_param), device)
        for original in refs_by_param:
            SHARDED_ORIGINALS.add(original, label)
    claimed: set[nn.Parameter] = set()
    units: list[UnitState] = []
    for m, refs in zip(modules, refs_by_module):
        _move_buffers(m, device)
        unit = UnitState(m, type(m).__name__, mesh, group, reshard_after_forward,
                         mp_policy, debug)
        if len(modules) > 1:  # each unit names only its own parameters (a tied one: the first)
            unit.own_params = [sharded[p] for p in refs if p not in claimed]
            claimed.update(refs)
        attach_unit(m, unit)
        units.append(unit)
    for unit in units:
        unit.created_with = units
    return units


def unit_label(modules: list) -> str:
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules; pass a module or a "
                         "non-empty list of modules to shard as one unit.")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: expected an nn.Module or a list of them, got "
                            f"{type(m).__name__}" + (f" at index {i}" if len(modules) > 1 else ""))
    names = [_class_name(m) for m in modules]
    return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def _check_shardable(label: str, module: nn.Module) -> None:
    name = _class_name(module)
    if unit_of(module) is not None:
        raise FullyShardArgumentError(torch_first(
            "Each distinct composable distributed API can only be applied to a module once.",
            f"fully_shard was already applied to this {name}; apply it once per module "
            "(submodules first, then the root)."))
    # torch.compile's OptimizedModule sets its forward on the instance
    if type(module).forward is nn.Module.forward and "forward" not in module.__dict__:
        raise ValueError(torch_first(
            f"fully_shard does not support containers that do not implement forward: {name}.",
            f"fully_shard({label}): this module has no forward() of its own (a container such "
            "as ModuleList/ModuleDict), so nothing would gather its parameters before use. "
            "Apply fully_shard to its children, or to the parent module that runs them."))


def _shard_dims(label: str, shard_placement_fn, refs_by_param: dict) -> dict:
    """torch's ``shard_placement_fn``: the dim each parameter is sharded on (default 0)."""
    if shard_placement_fn is None:
        return {}
    if not callable(shard_placement_fn):
        raise TypeError(f"fully_shard({label}): shard_placement_fn must be callable as "
                        f"fn(param) -> Shard | None, got {type(shard_placement_fn).__name__}.")
    dims = {}
    for p, refs in refs_by_param.items():
        placement = shard_placement_fn(p)
        if placement is None:
            continue
        ndim = p.to_local().dim() if isinstance(p, DTensor) else p.dim()
        if not isinstance(placement, Shard):
            raise FullyShardArgumentError(torch_first(
                f"Expected Shard, got {type(placement)}: {placement}",
                _placement_guidance(label, placement, refs[0].fqn, ndim)))
        if not -ndim <= placement.dim < ndim:
            raise FullyShardArgumentError(torch_first(
                f"Shard dim {placement.dim} is invalid for {ndim}D tensor: {p.shape}",
                _placement_guidance(label, placement, refs[0].fqn, ndim)))
        dims[p] = placement.dim % ndim
    return dims


def _placement_guidance(label: str, placement, fqn: str, ndim: int) -> str:
    return (f"fully_shard({label}): shard_placement_fn returned {placement!r} for parameter "
            f"'{fqn}' ({ndim}-D); it must return None or Shard(dim) with -{ndim} <= dim < "
            f"{ndim}.")


def _check_tensor_parallel(label: str, params, post_forward_size: int | None) -> None:
    tp = next((p for p in params if p.tp_spec is not None), None)
    if tp is not None and post_forward_size is not None:
        raise NotImplementedError(
            f"fully_shard({label}): reshard_after_forward={post_forward_size} (reshard to a "
            f"smaller group) with tensor-parallel parameter '{tp.fqn}'; pass True or False.")


def _check_reshard_after_forward(label: str, reshard_after_forward, shard_size: int) -> None:
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return
    if not isinstance(reshard_after_forward, int):
        raise TypeError(f"fully_shard({label}): reshard_after_forward must be a bool or an int, "
                        f"got {type(reshard_after_forward).__name__}.")
    n = reshard_after_forward
    if n < 1 or n > shard_size or shard_size % n:
        raise ValueError(
            f"fully_shard({label}): reshard_after_forward={n} must divide the shard group size "
            f"{shard_size} (1 <= N <= {shard_size}): after forward each group of N ranks "
            "keeps the parameters sharded N ways for backward.")


# (device, dtype) -> whether a matmul runs there. Process-wide because the answer is a
# property of the installed torch and the hardware; probing allocates on the device.
_COMPUTABLE: dict[tuple[torch.device, torch.dtype], bool] = {}


def can_compute_in(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a matrix multiply in ``dtype`` runs on ``device`` (probed once)."""
    key = (device, dtype)
    if key not in _COMPUTABLE:
        try:
            ones = torch.ones(2, 2, dtype=dtype, device=device)
            torch.mm(ones, ones)
            _COMPUTABLE[key] = True
        except RuntimeError:
            _COMPUTABLE[key] = False
    return _COMPUTABLE[key]


def _check_compute_dtype(label: str, dtype: torch.dtype | None, device: torch.device) -> None:
    if dtype is not None and not can_compute_in(device, dtype):
        raise ValueError(f"fully_shard({label}): mp_policy.param_dtype={dtype} cannot be "
                         f"computed in on {device} (a matmul in it fails there); use "
                         "torch.float16 or torch.float32 on this device.")


def _kept_in_own_dtype(label: str, mp_policy: MixedPrecisionPolicy,
                       refs_by_param: dict[nn.Parameter, list[ParamRef]]) -> set[nn.Parameter]:
    """The parameters ``mp_policy.param_dtype_override_fn`` keeps in their own dtype
    (torch 2.15's rule: it may return None, param_dtype or the parameter's dtype)."""
    override = mp_policy.param_dtype_override_fn
    if override is None or mp_policy.param_dtype is None:
        return set()
    kept = set()
    for p, refs in refs_by_param.items():
        dtype = override(p)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"fully_shard({label}): param_dtype_override_fn returned "
                             f"{type(dtype).__name__} for parameter '{refs[0].fqn}'; it must "
                             "return a torch.dtype or None.")
        if dtype not in (None, mp_policy.param_dtype, p.dtype):
            raise ValueError(
                f"fully_shard({label}): param_dtype_override_fn returned {dtype} for "
                f"parameter '{refs[0].fqn}' ({p.dtype}); it must return None, param_dtype "
                f"({mp_policy.param_dtype}) or the parameter's own dtype.")
        if dtype == p.dtype and dtype != mp_policy.param_dtype:
            kept.add(p)
    return kept


def _check_arguments(label, mp_policy, offload_policy
                     ) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The policies as fullshard's (torch's are accepted), checked."""
    mp_policy = as_mp_policy(mp_policy, label)
    offload_policy = as_offload_policy(offload_policy, label)
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and (not isinstance(dtype, torch.dtype)
                                  or not dtype.is_floating_point):
            raise ValueError(f"fully_shard({label}): mp_policy.{field}={dtype!r} is not a "
                             "floating-point torch.dtype (use torch.bfloat16, torch.float16 "
                             "or torch.float32).")
    return mp_policy, offload_policy


def _collect_params(module: nn.Module, label: str, ignored: set[nn.Parameter],
                    mesh: DeviceMesh, spmd: SpmdDims | None
                    ) -> dict[nn.Parameter, list[ParamRef]]:
    """The parameters this unit manages: those of ``module`` and its submodules that no
    sharded submodule manages, each with every place it is registered (tied weights).
    DTensors on another mesh than ``mesh`` (tensor parallel), or on the whole mesh given
    with ``dp_mesh_dims``, are managed too."""
    refs: dict[nn.Parameter, list[ParamRef]] = {}
    for prefix, sub in managed_modules(module):
        for name, p in sub._parameters.items():
            if p is None or p in ignored:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            if spmd is not None:
                _check_spmd_param(label, fqn, p, spmd)
            if is_sharded_param(p):
                raise ValueError(
                    f"fully_shard({label}): parameter '{fqn}' is already a sharded DTensor: "
                    "fully_shard was applied to a module enclosing this one (or the parameter "
                    "is shared with a unit sharded earlier). Apply fully_shard bottom-up: "
                    "submodules first, then their parent, the root last.")
            if isinstance(p, DTensor):
                refuse_param_of_torch_fsdp2(label, fqn, p)
                refuse_unrelated_tp_mesh(label, fqn, p, mesh, spmd is not None)
            if isinstance(p, DTensor) and not (
                    is_foreign_dtensor(p, mesh)
                    or (spmd is not None and p.device_mesh == spmd.mesh)):
                raise ValueError(
                    f"fully_shard({label}): parameter '{fqn}' is a DTensor on the "
                    f"data-parallel mesh {mesh} itself; a tensor-parallel parameter must "
                    "live on another dimension of the same mesh: parallelize_module(..., "
                    "world_mesh['tp'], plan), then fully_shard(..., mesh=world_mesh['dp']).")
            owner = SHARDED_ORIGINALS.get(p)
            if owner is not None:
                # torch's words first: callers match them (docs/errors.md E06)
                raise ValueError(
                    f"Parameter '{fqn}' is shared with a parameter already managed by another "
                    "FSDP group. For shared/tied parameters, use fully_shard([module_a, "
                    "module_b]) to place them in the same FSDP group. "
                    f"fully_shard({label}): parameter '{fqn}' is also managed by fully_shard"
                    f"({owner}); a parameter shared between two units is not supported. Shard "
                    "the modules that share it together: apply fully_shard to their common "
                    "parent only (e.g. leave tied embeddings to the root).")
            check_subclass_param(label, fqn, p)
            if not (p.is_floating_point() or p.is_complex()):
                raise ValueError(
                    f"fully_shard({label}): parameter '{fqn}' has dtype {p.dtype}; fullshard "
                    "shards floating-point parameters (their gradients are averaged). Register "
                    "it as a buffer (module.register_buffer) or pass it in ignored_params.")
            refs.setdefault(p, []).append(ParamRef(sub, name, fqn))
    return refs


def _check_spmd_param(label: str, fqn: str, p: nn.Parameter, spmd: SpmdDims) -> None:
    """With ``dp_mesh_dims`` every parameter is a DTensor on the mesh given, even where
    every dimension is data parallel: torch refuses a plain one, so fullshard does too
    (code that shards on torch must not pass here only)."""
    if not isinstance(p, DTensor):
        # torch's words first: callers match them (docs/errors.md E48)
        raise ValueError(torch_first(
            "When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD "
            f"mesh (e.g. via distribute_module). Got plain tensor for parameter '{fqn}'.",
            f"fully_shard({label}): parameter '{fqn}' is a plain tensor; with dp_mesh_dims "
            f"every parameter must be a DTensor on the mesh {spmd.mesh.mesh_dim_names} "
            "(distribute_module or parallelize_module with it first), or leave out "
            "dp_mesh_dims and pass the data-parallel mesh alone."))


def managed_modules(module: nn.Module, prefix: str = ""):
    """``(path, module)`` for ``module`` and every submodule no sharded unit below it
    manages: the modules whose parameters a ``fully_shard(module)`` takes."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is None or unit_of(child) is not None:
            continue
        yield from managed_modules(child, f"{prefix}.{name}" if prefix else name)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for _, sub in managed_modules(module):
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                sub._buffers[name] = buf.to(device)


def _class_name(module: nn.Module) -> str:
    """The module's own class name (a unit's class is fully_shard's subclass of it)."""
    unit = unit_of(module)
    return unit.label if unit is not None else type(module).__name__


@outside_special_modes  # a flat shard readopted here is what the optimizer updates
def lazy_init(unit: UnitState, all_units: list[UnitState], bucket_numel: int) -> RootState:
    """Make ``unit`` the root of ``all_units`` (its subtree), check they can run, and
    gather small adjacent units in batches (core/buckets.py)."""
    check_units_fit_root(unit, all_units)
    for u in all_units:
        if u.group is None:
            continue
        _check_not_meta(u.group)
        _check_no_hooks_set_after_sharding(u.group)
        u.group.reshard()
        _readopt_if_replaced(u.group)
        follow_grad_dtypes(u.group)  # Note [a parameter's grad_dtype]
    merge_small_units(all_units, bucket_numel, root=unit)
    root = RootState(unit, all_units)
    root.start_iteration()
    for u in all_units:
        u.root = root
    return root


def _check_not_meta(group: ParamGroup) -> None:
    on_meta = []
    for p in group.params:
        ref = p.refs[0]
        current = ref.module._parameters.get(ref.name)
        if current is not None and current.is_meta:
            on_meta.append(p.fqn)
    if on_meta:
        raise RuntimeError(torch_first(
            "FSDP parameters should be materialized from meta device before training, but "
            f"the following were still on meta device: {on_meta}",
            f"fullshard: parameter '{on_meta[0]}' is still on the meta device at the first "
            "forward. After fully_shard, call model.to_empty(device=...) and then "
            "initialize it (reset_parameters() / init_weights()) or load a checkpoint."))


def _check_no_hooks_set_after_sharding(group: ParamGroup) -> None:
    """torch's FSDP2 looks for ``fsdp_pre_all_gather`` on a parameter's local tensor at
    every gather, so hooks set on that object after sharding take effect there. fullshard
    chooses a parameter's path once, in ``fully_shard`` (a plain parameter is a view of
    the unit's flat shard, Note [tensor-subclass parameters]): hooks that appear later
    would be ignored silently, so they are refused at the first forward (checked once)."""
    for p in group.params:
        if p.extension is None and has_all_gather_hooks(p.sharded_param._local_tensor):
            raise NotImplementedError(
                f"fullshard: parameter '{p.fqn}' of fully_shard({group.unit_name}) had "
                "fsdp_pre_all_gather/fsdp_post_all_gather set on its local shard after "
                "fully_shard; fullshard reads them once, when fully_shard runs, and would "
                "ignore them. Define both on the parameter's tensor subclass before "
                "fully_shard.")


def _readopt_if_replaced(group: ParamGroup) -> None:
    if group.state is not GroupState.SHARDED:
        return
    for p in group.params:
        ref = p.refs[0]
        if ref.module._parameters.get(ref.name) is not p.sharded_param:
            group.readopt()
            return
