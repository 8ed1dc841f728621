"""``fully_shard`` and ``FSDPModule``: the FSDP2-compatible front of fullshard."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from . import optim
from .core import cpu_allocator, hooks
from .core.group import ParamGroup
from .core.load_check import check_fits
from .core.originals import SHARDED_ORIGINALS
from .core.param import ParamRef, ShardedParam
from .core.state import UnitState, default_process_group_or_raise, mesh_device_type
from .core.tensor_parallel import SpmdDims, is_foreign_dtensor
from .controls import TorchControls
from .policies import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, as_mp_policy,
                       as_offload_policy)



_FSDP_CLASSES: dict[tuple[type, type], type] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the gather."""

    def __init__(self, unit: UnitState):
        self._unit = unit

    def wait(self) -> None:
        if self._unit.group is not None:
            self._unit.group.wait_unshard()


class FSDPModule(TorchControls):
    """Mixed into every module passed to ``fully_shard`` (``isinstance`` checks both)."""

    def __new__(cls, *args, **kwargs):
        # Containers rebuild themselves with self.__class__(...) (nn.Sequential slicing):
        # construct the original class then.
        orig = cls._fullshard_original_class
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        raise TypeError(_no_copy_message(self, "copy.deepcopy"))

    def __reduce_ex__(self, protocol):
        raise TypeError(_no_copy_message(self, "pickling (torch.save of the module)"))

    @property
    def _unit(self) -> UnitState:
        return self.__dict__["_fullshard_unit"]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now (e.g. to start the first gather before
        forward). With ``async_op=True`` returns a handle whose ``wait()`` finishes it."""
        unit = self._unit
        hooks.ensure_root(unit)
        unit.explicit_unshard = True
        if unit.group is not None:
            unit.group.unshard(async_op=async_op)
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters and register the sharded ones."""
        unit = self._unit
        unit.explicit_unshard = False
        if unit.group is not None:
            unit.group.reshard()

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Gather ``modules`` asynchronously as soon as this module's forward starts,
        instead of the implicit one group ahead (deeper prefetch, more memory)."""
        self._unit.forward_prefetch = _prefetch_targets("set_modules_to_forward_prefetch",
                                                        modules)

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Gather ``modules`` asynchronously as soon as this module's backward starts,
        instead of the implicit one group behind in forward order."""
        self._unit.backward_prefetch = _prefetch_targets("set_modules_to_backward_prefetch",
                                                         modules)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """With ``False``, backward keeps each unit's unsharded gradients (accumulating
        across backward passes) instead of reduce-scattering them; the next backward
        with ``True`` reduces everything accumulated. Trades memory for communication
        in gradient accumulation; applies to sharded submodules too unless ``recurse``
        is False."""
        self._set_unit_flag("requires_gradient_sync", requires_gradient_sync, recurse)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """With ``False``, parameters stay gathered after backward so the next forward
        needs no all-gather (gradient accumulation with ``no_sync``). Set it back to
        ``True`` for the last micro-batch: parameters gathered before an optimizer step
        would be stale."""
        self._set_unit_flag("reshard_after_backward", reshard_after_backward, recurse)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Call on the root. With ``False`` the end of backward does not wait for the last
        reduce-scatter: it overlaps the next micro-batch and completes at the next
        backward, forward or ``optimizer.step()``. Read ``.grad`` only after one of those
        (or after a backward with ``True``)."""
        self._set_unit_flag("is_last_backward", is_last_backward, recurse=False)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside skip gradient reduction (as FSDP1/DDP ``no_sync``); the
        first backward after the block reduces everything accumulated."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def set_bucket_numel(self, numel: int) -> None:
        """Merge adjacent small units under this root into one collective while their
        unsharded size stays <= ``numel`` elements (default 2**20; 0 disables). Call it
        on the root before the first forward; see Note [buckets: units share a group]."""
        unit = self._unit
        if unit.root is not None:
            raise RuntimeError(
                f"set_bucket_numel on {unit.name}: the units were already grouped at the first "
                "forward/unshard; call it right after fully_shard, before running the model.")
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"set_bucket_numel: numel must be an int >= 0, got {numel!r}")
        unit.bucket_numel = numel

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, except that a missing key (with ``strict``) or a
        shape mismatch raises before anything is copied, naming the key: torch's own
        load copies every entry that fits first and leaves a half-loaded model."""
        check_fits(self, state_dict, "", strict, self._unit.name, FSDPModule)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, *args, **kwargs):
        # .to()/.cuda()/to_empty() replace the DTensor parameters; re-point them at the
        # unit's flat shard so gathers read what the module holds.
        self.reshard()
        ret = super()._apply(*args, **kwargs)
        group = self._unit.group
        if group is not None:
            with torch.no_grad():
                group.readopt()
        return ret


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
            of ``mesh`` (one shard dimension, at most one replicate dimension). When it
            names only some of them, ``mesh`` is the whole mesh and every parameter must be
            a DTensor on it, ``Replicate()`` on the data-parallel dimensions; each is
            sharded over them as torch does (Note [sharding a tensor-parallel parameter]).
        debug: on the root (or with ``FULLSHARD_DEBUG=1``): compare a fingerprint of every
            collective across ranks first, so ranks that take different paths raise an
            error naming the unit instead of hanging (slower; for debugging).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    label = _unit_label(modules)
    mp_policy, offload_policy = _check_arguments(label, mp_policy, offload_policy)
    if not isinstance(debug, bool):
        raise TypeError(f"fully_shard({label}): debug must be a bool, got {debug!r}.")
    for m in modules:
        _check_shardable(label, m)
    spmd = _data_parallel_mesh(label, mesh, dp_mesh_dims)
    mesh = _resolve_mesh(label, spmd.dp_mesh if spmd else mesh)
    pg = mesh.get_group(mesh.ndim - 1)  # the shard dimension is the last one
    replicate_pg = mesh.get_group(0) if mesh.ndim == 2 else None
    post_forward_size = _post_forward_size(label, reshard_after_forward, pg.size())
    if reshard_after_forward == 1 and not isinstance(reshard_after_forward, bool):
        reshard_after_forward = False  # each rank keeps everything: ZeRO-2
    device = mesh_device(mesh)
    _check_compute_dtype(label, mp_policy.param_dtype, device)
    if device.type == "cpu":
        cpu_allocator.tune_for_sharded_training()
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
        sharded = {p: ShardedParam(refs, p, mesh, pg.rank(), pg.size(), label, spmd,
                                   shard_dims.get(p, 0))
                   for p, refs in refs_by_param.items()}
        _check_tensor_parallel(label, sharded.values(), post_forward_size)
        group = ParamGroup(list(sharded.values()), pg, label, mp_policy.param_dtype,
                           mp_policy.reduce_dtype, replicate_pg, post_forward_size,
                           offload=offload_policy if isinstance(offload_policy, CPUOffloadPolicy)
                           else None)
        group.shard(list(refs_by_param), device)
        for original in refs_by_param:
            SHARDED_ORIGINALS.add(original, label)
    claimed: set[nn.Parameter] = set()
    units: list[UnitState] = []
    for m, refs in zip(modules, refs_by_module):
        _move_buffers(m, device)
        unit = UnitState(m, _original_class(m).__name__, mesh, group, reshard_after_forward,
                         mp_policy, debug)
        if len(modules) > 1:  # each unit names only its own parameters (a tied one: the first)
            unit.own_params = [sharded[p] for p in refs if p not in claimed]
            claimed.update(refs)
        m.__dict__["_fullshard_unit"] = unit
        m.__class__ = fsdp_class(type(m))
        hooks.install(unit)
        _register_state_dict_hooks(unit)
        units.append(unit)
    for unit in units:
        unit.created_with = units
    return modules if isinstance(module, (list, tuple)) else module


def _no_copy_message(module: nn.Module, what: str) -> str:
    return (f"{what} of a sharded {_original_class(module).__name__} is not supported: its "
            "parameters are shards tied to this process group. Copy the state instead: "
            "build another model, fully_shard it, and load this one's state_dict() (or save "
            "it with fullshard.checkpoint / torch.distributed.checkpoint).")


def _unit_label(modules: list) -> str:
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules; pass a module or a "
                         "non-empty list of modules to shard as one unit.")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: expected an nn.Module or a list of them, got "
                            f"{type(m).__name__}" + (f" at index {i}" if len(modules) > 1 else ""))
    names = [_original_class(m).__name__ for m in modules]
    return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def _check_shardable(label: str, module: nn.Module) -> None:
    name = _original_class(module).__name__
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {name}; apply it once per "
                         "module (submodules first, then the root).")
    # torch.compile's OptimizedModule sets its forward on the instance
    if type(module).forward is nn.Module.forward and "forward" not in module.__dict__:
        raise ValueError(
            f"fully_shard({label}): this module has no forward() of its own (a container such "
            "as ModuleList/ModuleDict), so nothing would gather its parameters before use. "
            "Apply fully_shard to its children, or to the parent module that runs them.")


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
        if not isinstance(placement, Shard) or not -ndim <= placement.dim < ndim:
            raise ValueError(
                f"fully_shard({label}): shard_placement_fn returned {placement!r} for "
                f"parameter '{refs[0].fqn}' ({ndim}-D); it must return None or Shard(dim) "
                f"with -{ndim} <= dim < {ndim}.")
        dims[p] = placement.dim % ndim
    return dims


def _check_tensor_parallel(label: str, params, post_forward_size: int | None) -> None:
    tp = next((p for p in params if p.tp_spec is not None), None)
    if tp is not None and post_forward_size is not None:
        raise NotImplementedError(
            f"fully_shard({label}): reshard_after_forward={post_forward_size} (reshard to a "
            f"smaller group) with tensor-parallel parameter '{tp.fqn}'; pass True or False.")


def _data_parallel_mesh(label: str, mesh: DeviceMesh | None, dp_mesh_dims
                        ) -> SpmdDims | None:
    """torch's ``dp_mesh_dims``: which named dimensions of ``mesh`` are data parallel."""
    if dp_mesh_dims is None:
        return None
    if mesh is None:
        raise ValueError(f"fully_shard({label}): dp_mesh_dims needs the mesh it names; pass "
                         "mesh= as well.")
    replicate = _dim_names(dp_mesh_dims.replicate)
    shard = _dim_names(dp_mesh_dims.shard)
    names = mesh.mesh_dim_names or ()
    if len(replicate) > 1 or len(shard) != 1 or not set(replicate + shard) <= set(names):
        raise NotImplementedError(
            f"fully_shard({label}): dp_mesh_dims {dp_mesh_dims} on the mesh {names}; "
            "fullshard takes one shard dimension and at most one replicate dimension, both "
            "named in the mesh. Flatten several data-parallel dimensions into one first "
            "(mesh['a', 'b']._flatten('dp')).")
    return SpmdDims(mesh, shard[0], replicate[0] if replicate else None)


def _dim_names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _prefetch_targets(method: str, modules) -> list[UnitState]:
    targets = []
    for i, m in enumerate(modules):
        if not isinstance(m, FSDPModule):
            raise ValueError(f"{method}: modules[{i}] ({type(m).__name__}) is not sharded; "
                             "pass modules that fully_shard was applied to.")
        targets.append(m._unit)
    return targets


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) gather the unit's parameters
    before it runs and free them after, as ``forward`` does. A no-op on modules that
    ``fully_shard`` was not applied to, so the same code runs sharded or not."""
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {_original_class(module).__name__} "
                         f"has no method {method_name!r}.")
    unit = module._unit

    @functools.wraps(method)
    def gathered(*args, **kwargs):
        args, kwargs = hooks.run_pre_forward(unit, args, kwargs)
        output = method(*args, **kwargs)
        return hooks.run_post_forward(unit, args, kwargs, output)

    module.__dict__[method_name] = gathered  # shadows the class's method on this instance


def _post_forward_size(label: str, reshard_after_forward, shard_size: int) -> int | None:
    """The subgroup size for an integer ``reshard_after_forward`` (None: not hpZ)."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return None
    if not isinstance(reshard_after_forward, int):
        raise TypeError(f"fully_shard({label}): reshard_after_forward must be a bool or an int, "
                        f"got {type(reshard_after_forward).__name__}.")
    n = reshard_after_forward
    if n < 1 or n > shard_size or shard_size % n:
        raise ValueError(
            f"fully_shard({label}): reshard_after_forward={n} must divide the shard group size "
            f"{shard_size} (1 <= N <= {shard_size}): after forward each group of N ranks "
            "keeps the parameters sharded N ways for backward.")
    return n if 1 < n < shard_size else None


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


def _resolve_mesh(label: str, mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is None:
        default_process_group_or_raise(f"fully_shard({label})")
        return init_device_mesh(mesh_device_type(), (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard({label}): mesh must be a torch DeviceMesh, got "
                        f"{type(mesh).__name__}.")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard({label}): mesh has {mesh.ndim} dimensions {tuple(mesh.shape)}; "
            "fullshard shards over a 1-D mesh, or a 2-D (replicate, shard) mesh for hybrid "
            "sharding. Pass those dimensions, e.g. mesh['replicate', 'shard'].")
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard({label}): this rank ({dist.get_rank()}) is not in the mesh (ranks "
            f"{mesh.mesh.flatten().tolist()}) of world size {dist.get_world_size()}; every rank "
            "that runs the model must be in its mesh. Build the mesh over those ranks, e.g. "
            "init_device_mesh(device_type, (world_size,)).")
    return mesh


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


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
            if optim.is_sharded_param(p):
                raise ValueError(
                    f"fully_shard({label}): parameter '{fqn}' is already a sharded DTensor: "
                    "fully_shard was applied to a module enclosing this one (or the parameter "
                    "is shared with a unit sharded earlier). Apply fully_shard bottom-up: "
                    "submodules first, then their parent, the root last.")
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
                raise ValueError(
                    f"fully_shard({label}): parameter '{fqn}' is also managed by fully_shard"
                    f"({owner}); a parameter shared between two units is not supported. Shard "
                    "the modules that share it together: apply fully_shard to their common "
                    "parent only (e.g. leave tied embeddings to the root).")
            if not (p.is_floating_point() or p.is_complex()):
                raise ValueError(
                    f"fully_shard({label}): parameter '{fqn}' has dtype {p.dtype}; fullshard "
                    "shards floating-point parameters (their gradients are averaged). Register "
                    "it as a buffer (module.register_buffer) or pass it in ignored_params.")
            refs.setdefault(p, []).append(ParamRef(sub, name, fqn))
    return refs


def _check_spmd_param(label: str, fqn: str, p: nn.Parameter, spmd: SpmdDims) -> None:
    """With ``dp_mesh_dims`` naming only some dimensions of the mesh, the others are model
    parallel: a plain parameter there has no layout on them (torch raises too)."""
    covered = {spmd.shard, spmd.replicate} >= set(spmd.mesh.mesh_dim_names)
    if not isinstance(p, DTensor) and not covered:
        raise ValueError(
            f"fully_shard({label}): parameter '{fqn}' is a plain tensor, but dp_mesh_dims "
            f"names only some dimensions of the mesh {spmd.mesh.mesh_dim_names}; every "
            "parameter must then be a DTensor on that mesh (distribute_module or "
            "parallelize_module with it first).")


def managed_modules(module: nn.Module, prefix: str = ""):
    yield prefix, module
    for name, child in module._modules.items():
        if child is None or isinstance(child, FSDPModule):
            continue
        yield from managed_modules(child, f"{prefix}.{name}" if prefix else name)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for _, sub in managed_modules(module):
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                sub._buffers[name] = buf.to(device)


def _original_class(module: nn.Module) -> type:
    cls = type(module)
    return cls._fullshard_original_class if isinstance(module, FSDPModule) else cls


def fsdp_class(cls: type, front: type = FSDPModule) -> type:
    """``FSDP<cls>``: a subclass of ``front`` (FSDPModule or a subclass) and ``cls``."""
    cls = getattr(cls, "_fullshard_original_class", cls)
    key = (cls, front)
    if key not in _FSDP_CLASSES:
        _FSDP_CLASSES[key] = type(f"FSDP{cls.__name__}", (front, cls),
                                  {"_fullshard_original_class": cls})
    return _FSDP_CLASSES[key]


def _register_state_dict_hooks(unit: UnitState) -> None:
    """state_dict()/load_state_dict() always see the sharded DTensors; a load with
    ``assign=True`` re-points the new DTensors at the unit's flat shard.

    The hooks read ``unit.group`` when they run, never at registration: at the first
    forward small units are merged into a shared group (core/buckets.py), and a hook
    holding the unit's first group re-pointed the loaded parameters at a retired flat
    shard that no all-gather reads any more (Note [one storage is the shard])."""
    if unit.group is None:
        return

    def to_sharded(*_args, **_kwargs) -> None:
        unit.group.reshard()

    def readopt(*_args, **_kwargs) -> None:
        with torch.no_grad():
            unit.group.readopt()

    unit.module.register_state_dict_pre_hook(to_sharded)
    unit.module.register_load_state_dict_pre_hook(to_sharded)
    unit.module.register_load_state_dict_post_hook(readopt)
