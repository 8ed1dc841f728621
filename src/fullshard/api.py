"""``fully_shard`` and ``FSDPModule``: the FSDP2-compatible front of fullshard."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .controls import TorchControls
from .core import hooks
from .core.init import shard_modules, unit_label
from .core.load_check import check_fits
from .core.state import UnitState, unit_of
from .policies import MixedPrecisionPolicy, OffloadPolicy

# (module class, front class) -> the FSDP<class> subclass. Process-wide so that every
# unit of one class gets the same class object (isinstance checks, torch.compile guards).
_FSDP_CLASSES: dict[tuple[type, type], type] = {}
# Set while FSDPModule.to_empty runs (per thread): torch's _apply recursion into the units
# carries no argument, and to_empty's values are undefined, so there is nothing to copy.
_EMPTYING = threading.local()


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
        return unit_of(self)

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

    def to_empty(self, *, device, recurse: bool = True):
        """``nn.Module.to_empty``: each unit's flat shard is allocated on ``device`` and,
        the values being undefined, nothing is copied into it (a model built on the meta
        device pays one allocation and no copy)."""
        outer = getattr(_EMPTYING, "active", False)
        _EMPTYING.active = True
        try:
            return super().to_empty(device=device, recurse=recurse)
        finally:
            _EMPTYING.active = outer

    def _apply(self, *args, **kwargs):
        # .to()/.cuda()/to_empty() replace the DTensor parameters; re-point them at the
        # unit's flat shard so gathers read what the module holds.
        self.reshard()
        ret = super()._apply(*args, **kwargs)
        group = self._unit.group
        if group is not None:
            with torch.no_grad():
                group.readopt(copy_values=not getattr(_EMPTYING, "active", False))
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
        debug: on the root (or with ``FULLSHARD_DEBUG=1``): compare what the ranks ran
            before every collective rather than after each forward and backward (Note
            [ranks agree on every collective]), so the first mismatch is named before it
            is issued (one exchange per collective; for debugging).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    units = shard_modules(modules, unit_label(modules), mesh=mesh,
                          reshard_after_forward=reshard_after_forward,
                          shard_placement_fn=shard_placement_fn, mp_policy=mp_policy,
                          offload_policy=offload_policy, ignored_params=ignored_params,
                          dp_mesh_dims=dp_mesh_dims, debug=debug)
    for unit in units:
        unit.module.__class__ = fsdp_class(type(unit.module))
        hooks.install(unit)
    return modules if isinstance(module, (list, tuple)) else module


def _no_copy_message(module: nn.Module, what: str) -> str:
    name = type(module)._fullshard_original_class.__name__
    return (f"{what} of a sharded {name} is not supported: its "
            "parameters are shards tied to this process group. Copy the state instead: "
            "build another model, fully_shard it, and load this one's state_dict() (or save "
            "it with fullshard.checkpoint / torch.distributed.checkpoint).")


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
