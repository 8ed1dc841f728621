"""``fully_shard`` and torch's other FSDP2 functions: the FSDP2-compatible front of
fullshard. What a sharded module can do is ``FSDPModule`` (fsdp_module.py)."""

from __future__ import annotations

import functools
from typing import Callable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .core import hooks
from .core.init import shard_modules, unit_label
from .placement_meshes import split_by_mesh
from .core.state import unit_of
from .core.refusals.torch_errors import torch_first
from .core.comm import SharedCopies
from .fsdp_module import FSDPModule
from .policies import MixedPrecisionPolicy, OffloadPolicy

# (module class, front class) -> the FSDP<class> subclass. Process-wide so that every
# unit of one class gets the same class object (isinstance checks, torch.compile guards).
_FSDP_CLASSES: dict[tuple[type, type], type] = {}


def fully_shard(module, *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None,
                dp_mesh_dims=None, debug: bool = False):
    """Shard ``module``'s parameters across ``mesh`` (data parallel, ZeRO-3 / ZeRO-2).

    Apply it to submodules first (e.g. each transformer block), then to the root.
    Every parameter not already managed by a sharded submodule becomes a DTensor
    sharded on dim 0; before the module's forward (and backward) they are
    all-gathered in one collective and freed afterwards; gradients are
    reduce-scattered (averaged over ranks) into sharded DTensor gradients.

    Args:
        module: the module to shard, returned with its class swapped to a subclass of
            both its class and :class:`FSDPModule`; or a list of modules sharded as one
            unit (one all-gather and one reduce-scatter for all of them, e.g. a final
            norm and output head), returned as that list.
        mesh: a 1-D DeviceMesh (default: every rank of the default process group), or a
            2-D (replicate, shard) mesh for hybrid sharding: shards within each shard
            group, replicas across; gradients are reduce-scattered within the shard
            group, then all-reduced across replicas. Parameters that are already
            DTensors on another dimension of the same mesh (``parallelize_module(m,
            world_mesh["tp"], plan)``, then ``mesh=world_mesh["dp"]``) have their local
            piece sharded over this mesh (FSDP + TP, Note [sharding a tensor-parallel
            parameter]).
        reshard_after_forward: free parameters after forward and gather them again in
            backward (``True``, ZeRO-3) or keep them until backward (``False``, ZeRO-2);
            an int N keeps them sharded N ways after forward so backward gathers within
            groups of N ranks (ZeRO++ hpZ). ``None`` (torch's default): ``True``, except
            for the root, which keeps them since backward starts with it; an explicit
            ``True`` on the root frees it too.
        shard_placement_fn: torch's per-parameter hook, ``fn(param) -> Shard(dim) | None``:
            shard that parameter on ``dim`` instead of 0 (evenly divisible, as in torch;
            Note [shards on another dim]).
        mp_policy: dtypes to gather/compute in (``param_dtype``), reduce gradients in
            (``reduce_dtype``) and cast outputs to (``output_dtype``); sharded parameters,
            gradients and optimizer states stay in the parameters' dtype. fullshard's
            policy or torch's.
        offload_policy: ``CPUOffloadPolicy()`` keeps the sharded parameters, gradients and
            optimizer states in CPU memory (pinned on CUDA machines) and copies each unit's
            shard to the device for its all-gather; the default (or ``None``) keeps them on
            the device. fullshard's policies or torch's.
        ignored_params: parameters to leave unsharded and unmanaged.
        dp_mesh_dims: torch's ``DataParallelMeshDims`` naming the data-parallel dimensions
            of ``mesh``: shard and replicate dimensions, each one name or several
            (flattened into one), or replicate dimensions alone (parameters kept whole,
            gradients all-reduced). ``mesh`` is then the whole mesh and every parameter
            must be a DTensor on it (as torch requires), ``Replicate()`` on the
            data-parallel dimensions; each is sharded over them as torch does (Note
            [data-parallel dimensions of an SPMD mesh]).
        debug: on the root (or with ``FULLSHARD_DEBUG=1``): compare what the ranks ran
            before every collective rather than after each forward and backward (Note
            [ranks agree on every collective]), so the first mismatch is named before it
            is issued (one exchange per collective; for debugging).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    label = unit_label(modules)
    # Note [parameters on meshes of their own]: those submodules become units first
    splits, shard_placement_fn = split_by_mesh(label, modules, mesh, shard_placement_fn,
                                               set(ignored_params or ()))
    for split in splits:
        fully_shard(split.module, mesh=split.mesh, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=split.placement_fn(), mp_policy=mp_policy,
                    offload_policy=offload_policy, ignored_params=ignored_params, debug=debug)
    units = shard_modules(modules, label, mesh=mesh,
                          reshard_after_forward=reshard_after_forward,
                          shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                          offload_policy=offload_policy, ignored_params=ignored_params,
                          dp_mesh_dims=dp_mesh_dims, debug=debug)
    companions = [unit_of(split.module) for split in splits]
    for unit in units:
        unit.companions = companions
        unit.module.__class__ = fsdp_class(type(unit.module))
        hooks.install(unit)
    return modules if isinstance(module, (list, tuple)) else module


def _state(module: nn.Module):
    """``fully_shard.state(module)``, torch's accessor: the state object of the unit
    ``fully_shard(module)`` made (one distinct object per call), or None for a module it
    was never applied to. fullshard's object is its ``UnitState``; torch's private
    attributes (``_fsdp_param_group``, ``_lazy_init``) are not on it."""
    return unit_of(module)


fully_shard.state = _state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) gather the unit's parameters
    before it runs and free them after, as ``forward`` does. A no-op on modules that
    ``fully_shard`` was not applied to, so the same code runs sharded or not."""
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        name = type(module)._fullshard_original_class.__name__
        raise ValueError(f"register_fsdp_forward_method: {name} "
                         f"has no method {method_name!r}.")
    unit = module._unit

    @functools.wraps(method)
    def gathered(*args, **kwargs):
        args, kwargs = hooks.run_pre_forward(unit, args, kwargs)
        output = method(*args, **kwargs)
        return hooks.run_post_forward(unit, args, kwargs, output)

    module.__dict__[method_name] = gathered  # shadows the class's method on this instance


def original_class(module: nn.Module) -> type:
    """The class ``module`` had before ``fully_shard`` made it ``FSDP<Class>`` (its own
    class if it was never sharded)."""
    return getattr(type(module), "_fullshard_original_class", type(module))


def fsdp_class(cls: type, front: type = FSDPModule) -> type:
    """``FSDP<cls>``: a subclass of ``front`` (FSDPModule or a subclass) and ``cls``."""
    cls = getattr(cls, "_fullshard_original_class", cls)
    key = (cls, front)
    if key not in _FSDP_CLASSES:
        _FSDP_CLASSES[key] = type(f"FSDP{cls.__name__}", (front, cls),
                                  {"_fullshard_original_class": cls})
    return _FSDP_CLASSES[key]


def share_comm_ctx(modules: list[nn.Module]) -> None:
    """torch's ``share_comm_ctx``: the roots of ``modules`` (pipeline stages) use one set
    of copy streams (core/comm.SharedCopies); collectives run on the process group's
    streams in any case (Note [streams and events])."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            name = type(module).__name__
            raise ValueError(torch_first(
                f"Expects list of FSDPModules but got {name}.",
                f"share_comm_ctx: {name} is not sharded; pass the modules fully_shard "
                "returned (each pipeline stage's root)."))
    shared = SharedCopies()
    for module in modules:
        unit = module._unit
        unit.shared_copies = shared
        if unit.is_root:  # already initialized: move it now
            unit.root.use_copies(shared)
