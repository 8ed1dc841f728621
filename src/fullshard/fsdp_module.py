"""``FSDPModule``: what every module passed to ``fully_shard`` becomes, and its handles.

Its methods are torch's ``FSDPModule`` API, with torch's signatures and semantics, on
every torch fullshard supports (those torch 2.15 added too: Note [torch versions]).
Each reads or changes the unit's state (``core/state.UnitState``, found with
``unit_of``) or its group; the work itself happens in ``core/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .core import comm_groups, hooks
from .core.refusals.load_check import check_fits
from .core.features.quantized_collectives import DEFAULT_BLOCK_SIZE
from .core.state import UnitState, unit_of
from .core.refusals.torch_errors import UnsupportedCopyError, torch_first

# Set while FSDPModule.to_empty runs (per thread): torch's _apply recursion into the units
# carries no argument, and to_empty's values are undefined, so there is nothing to copy.
_EMPTYING = threading.local()

class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the gather."""

    def __init__(self, unit: UnitState):
        self._unit = unit

    def wait(self) -> None:
        for unit in self._unit.gathered_together():
            if unit.group is not None:
                unit.group.wait_unshard()


class GradientReductionHandle:
    """What ``finalize_backward(async_op=True)`` returns: ``wait()`` before reading the
    gradients or starting the next forward (torch 2.15's name)."""

    def __init__(self, root):
        self._root = root
        self._invalidated = False

    def invalidate(self) -> None:
        """``reset_iter_state`` dropped the reduction this handle waits for."""
        self._root, self._invalidated = None, True

    def wait(self) -> None:
        """Wait for the gradient reduction and release what it holds (once)."""
        if self._invalidated:
            raise RuntimeError("This gradient reduction handle was invalidated by "
                               "reset_iter_state; its gradients were discarded")
        root, self._root = self._root, None
        if root is not None:
            root.backward.handle = None
            root.settle_gradients()


def _set_manual_finalization(unit: UnitState, enabled: bool) -> None:
    """``set_manual_backward_finalization``: on the root, and not while a backward runs."""
    _expect_bool("set_manual_backward_finalization", enabled)
    if unit.root is not None and unit.root.unit is not unit:
        raise RuntimeError(f"set_manual_backward_finalization must be called on the root "
                           f"module, not {unit.name}")
    if (unit.root is not None and unit.root.backward.running
            and enabled != unit.manual_backward_finalization):
        raise RuntimeError("set_manual_backward_finalization cannot change mode during "
                           "backward")
    unit.manual_backward_finalization = enabled


def _finalize(unit: UnitState, async_op: bool) -> "GradientReductionHandle | None":
    """``finalize_backward``: wait for the root's reduction now, or hand out the handle."""
    _expect_bool("finalize_backward(async_op=)", async_op)
    root = unit.root
    if root is not None and root.unit is not unit:
        raise RuntimeError(f"finalize_backward must be called on the root module, not "
                           f"{unit.name}")
    if root is not None and root.backward.running:
        raise RuntimeError("finalize_backward: a backward is still running; call it "
                           "after loss.backward() returns")
    if root is not None and root.backward.handle is not None:
        raise RuntimeError("The previous gradient reduction must be waited on before "
                           "finalizing backward again")
    handle = GradientReductionHandle(root)
    if not async_op:
        handle.wait()
        return None
    if root is not None:
        root.backward.handle = handle
    return handle


class FSDPModule:
    """Mixed into every module passed to ``fully_shard`` (``isinstance`` checks both)."""

    def __new__(cls, *args, **kwargs):
        # Containers rebuild themselves with self.__class__(...) (nn.Sequential slicing):
        # construct the original class then.
        orig = cls._fullshard_original_class
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        raise UnsupportedCopyError(torch_first(
            "FSDP does not support deepcopy. Please use state dict for serialization.",
            _no_copy_message(self, "copy.deepcopy")))

    def __reduce_ex__(self, protocol):
        raise TypeError(_no_copy_message(self, "pickling (torch.save of the module)"))

    @property
    def _unit(self) -> UnitState:
        return unit_of(self)

    # -- gathering and prefetching ------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now (e.g. to start the first gather before
        forward). With ``async_op=True`` returns a handle whose ``wait()`` finishes it."""
        unit = self._unit
        guard = hooks.ensure_root(unit).guard
        # compare first where gloo would abort: Note [an unshard() on some ranks only]
        compare_first = guard is not None and not guard.lagged
        try:
            if compare_first:
                guard.compare_first = True
            for u in unit.gathered_together():
                u.explicit_unshard = True
                if u.group is not None:
                    u.group.unshard(async_op=async_op)
        finally:
            if compare_first:
                guard.compare_first = False
        return UnshardHandle(unit) if async_op else None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters and register the sharded ones."""
        for u in self._unit.gathered_together():
            u.explicit_unshard = False
            if u.group is not None:
                u.group.reshard()

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

    # -- gradient sync and the end of backward ----------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """With ``False``, backward keeps each unit's unsharded gradients (accumulating
        across backward passes) instead of reduce-scattering them; the next backward
        with ``True`` reduces everything accumulated. Trades memory for communication
        in gradient accumulation; applies to sharded submodules too unless ``recurse``
        is False."""
        _set_flag(self, "requires_gradient_sync", requires_gradient_sync, recurse)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """With ``False``, parameters stay gathered after backward so the next forward
        needs no all-gather (gradient accumulation with ``no_sync``). Set it back to
        ``True`` for the last micro-batch: parameters gathered before an optimizer step
        would be stale."""
        _set_flag(self, "reshard_after_backward", reshard_after_backward, recurse)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Call on the root. With ``False`` the end of backward does not wait for the last
        reduce-scatter: it overlaps the next micro-batch and completes at the next
        backward, forward or ``optimizer.step()``. Read ``.grad`` only after one of those
        (or after a backward with ``True``)."""
        _set_flag(self, "is_last_backward", is_last_backward, recurse=False)

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
        on the root before the first forward; see Note [buckets: units gather together]."""
        unit = self._unit
        if unit.root is not None:
            raise RuntimeError(
                f"set_bucket_numel on {unit.name}: the units were already grouped at the first "
                "forward/unshard; call it right after fully_shard, before running the model.")
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"set_bucket_numel: numel must be an int >= 0, got {numel!r}")
        unit.bucket_numel = numel

    # -- iteration state and resharding --------------------------------------------------
    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: wait for collectives in flight,
        reshard every group and clear the iteration's bookkeeping, on the root. Gradients
        of the failed iteration (also those accumulated without sync) are discarded."""
        unit = self._unit
        if unit.root is None or unit.root.unit is not unit:
            raise RuntimeError(f"reset_iter_state on {unit.name}: call it on the root module "
                               "(the one whose forward runs first).")
        unit.root.reset_iteration()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True
                                  ) -> None:
        """Free (True) or keep (False) parameters after forward from now on; ``True`` on
        the root frees it too. A unit built with an int N keeps its N-way layout."""
        _set_flag(self, "reshard_after_forward", reshard_after_forward, recurse)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With ``False`` backward never gathers this unit's parameters: for units whose
        backward reads none of them (an embedding). Gradients are still reduced."""
        _set_flag(self, "unshard_in_backward", unshard_in_backward, recurse=False)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """On the root: the next forward's first gathers wait on ``event`` (recorded after
        the optimizer step), then forget it; call again each iteration."""
        if not hasattr(event, "wait"):
            raise TypeError(f"set_post_optim_event: expected a torch.Event, got "
                            f"{type(event).__name__}")
        self._unit.post_optim_event = event

    # -- torch 2.15's backward finalization and storage --------------------------------------
    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root, before backward: with ``True`` the caller ends each logical
        backward with :meth:`finalize_backward` (after one or several backward passes),
        which supersedes :meth:`set_is_last_backward`. Every pass still reduces and
        reshards as its settings say; ``finalize_backward`` waits for the last reduction."""
        _set_manual_finalization(self._unit, enabled)

    def finalize_backward(self, *, async_op: bool = False) -> "GradientReductionHandle | None":
        """Finish the logical backward on the root: wait for the gradient reduction still in
        flight (and host copies), so every ``.grad`` is final. With ``async_op=True`` the
        wait is left to the returned handle's ``wait()``. A no-op before the first forward."""
        return _finalize(self._unit, async_op)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep (``True``) the gathered parameters' storage allocated when resharding, so
        the unsharded parameters keep their addresses across iterations (CUDA graph
        capture), at the memory of holding them; ``False`` (the default) frees it. Applies
        to the unit's gathered buffer: units gathered in one batch share it."""
        _expect_bool("set_keep_unsharded_storage", keep)
        for unit in _units(self, recurse):
            if unit.group is not None:
                unit.group.unsharded.keep_storage = keep

    # -- gradient reduction -----------------------------------------------------------------
    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True
                                ) -> None:
        """Hybrid sharding: with ``False`` gradients are reduce-scattered within the shard
        group but not all-reduced across replicas; the sum is kept and added to the next
        reduction that does (gradient accumulation with only intra-group traffic)."""
        _expect_bool("set_requires_all_reduce", requires_all_reduce)
        for unit in _units(self, recurse):
            unit.reduce_options = dataclasses.replace(unit.reduce_options,
                                                      all_reduce=requires_all_reduce)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, "
                             f"got {factor!r}")
        _set_reduce(self._unit, "set_gradient_divide_factor", divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """fullshard's collectives always sum and divide afterwards; with ``True`` an
        all-reduce hook sees the sum (divided after it), as with torch."""
        _expect_bool("set_force_sum_reduction_for_comms", enable)
        _set_reduce(self._unit, "set_force_sum_reduction_for_comms", force_sum=enable)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream=None) -> None:
        """Call ``hook(reduced)`` on this unit's reduced gradient shard (flat, in the
        reduce dtype) after the reduce-scatter, or after the replica all-reduce under
        hybrid sharding; it may modify it in place (e.g. all-reduce it over another mesh
        dimension). It runs on ``stream`` when given (ordered after the work before it;
        the work after it waits for it), else on the current stream; as in torch,
        ``stream`` is refused under hybrid sharding."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable, got "
                            f"{type(hook).__name__}")
        group = self._unit.group
        if stream is not None and group is not None and group.replicate_pg is not None:
            # torch's message word for word: callers compare str(error) with it.
            raise ValueError("stream cannot be set when using native HSDP")
        if stream is not None:
            hook = _on_stream(hook, stream, torch.get_device_module(self._unit.mesh.device_type))
        _set_reduce(self._unit, "set_all_reduce_hook", hook=hook)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Whether a trainable parameter that no rank used in a backward gets a zero
        gradient (True, as torch's FSDP2 then does) or keeps ``grad=None`` (False, the
        default, as in one process). Either way, ranks that used different parameters
        (an expert without tokens on one rank) reduce the same units in the same order,
        zeros standing for the missing gradients (Note [when a unit's backward is done],
        Note [gradient presence flags]); torch's FSDP2 needs True for that."""
        _expect_bool("set_reduce_scatter_unused_params", reduce_scatter_unused_params)
        for unit in _units(self, recurse):  # a merged group reduces zeros if any unit asks
            unit.reduce_options = dataclasses.replace(
                unit.reduce_options, unused_as_zeros=reduce_scatter_unused_params)

    # -- custom collectives ------------------------------------------------------------------
    def set_custom_all_gather(self, comm) -> None:
        """Gather this unit's parameters with ``comm`` (torch's ``AllGather``: ``allocate``
        plus a call), Note [custom collectives]."""
        _set_comm(self._unit, "set_custom_all_gather", "all_gather_comm", comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """Reduce this unit's gradients with ``comm`` (torch's ``ReduceScatter``), called
        with ``op=ReduceOp.SUM``; the mean is taken afterwards, Note [custom collectives]."""
        _set_comm(self._unit, "set_custom_reduce_scatter", "reduce_scatter_comm", comm)

    # -- quantized communication (fullshard's; ZeRO++'s qwZ and qgZ) -------------------------
    def set_quantized_communication(self, *, weights: bool = False, grads: bool = False,
                                    block_size: int = DEFAULT_BLOCK_SIZE,
                                    recurse: bool = True) -> None:
        """All-gather this unit's parameters (``weights``) and/or reduce-scatter its
        gradients (``grads``) as int8 with one fp32 scale per ``block_size`` elements, the
        gradients summed in fp32 (Note [quantized communication]). ``False`` restores
        full precision. The sharded parameters, optimizer and checkpoints stay exact; the
        gathered copy and the reduced gradients carry the rounding. With hybrid sharding
        the all-reduce across replicas stays in the reduce dtype."""
        _set_quantized(self._unit, _units(self, recurse), weights, grads, block_size)

    # -- communication tuning (core/comm_groups.py) -----------------------------------------
    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """Let up to ``max_input_buffers`` gradient reductions (each holding its send
        buffer) stay in flight when the next one starts, instead of one: the oldest is
        finished when one more would exceed it, all of them at the end of backward, in
        order, so gradients are the same (Note [reductions in flight]). More overlap for a
        reduce-scatter slower than backward, at the memory of the extra buffers. The root
        uses the largest value among its units."""
        comm_groups.check_reduces_in_flight(max_input_buffers, "max_input_buffers")
        comm_groups.change(self._unit, _units(self, recurse),
                           "set_reduce_scatter_max_input_buffers",
                           reduces_in_flight=max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """With ``True`` gradient reduce-scatters run on a process group of their own over
        the same ranks (made now, one per distinct rank set, as torch does), so on NCCL
        they progress while all-gathers run; ``False`` goes back to the shard group. Call
        it on every rank alike (making a group is collective). Note [a reduce-scatter
        group of its own]."""
        method = "set_separate_reduce_scatter_group"
        _expect_bool(method, enable)
        comm_groups.separate_reduce_groups(
            comm_groups.groups_of(self._unit, _units(self, recurse), method), enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """With ``True`` this unit's all-gather output and reduce-scatter input come from
        the process group's own allocator where its backend offers one (NCCL: memory it
        can send zero-copy); where it offers none (gloo, CPU) from fullshard's pool, as
        without it. Refused beside a custom collective or symmetric memory, as in torch.
        Note [staging buffers from the process group]."""
        _expect_bool("set_allocate_memory_from_process_group_for_comm", enable)
        comm_groups.allocate_from_process_group(self._unit, _made_together(self._unit),
                                                enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Gather this unit's parameters into symmetric memory, so NCCL can use its
        copy-engine or symmetric-kernel all-gather. Where symmetric memory cannot work (a
        torch built without it, CPU devices) this raises, as torch's does. Refused beside
        a custom collective or process-group allocation, as in torch. Note [staging
        buffers from the process group]."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: only the 'NCCL' backend exists, got "
                             f"{backend!r}")
        comm_groups.use_symmetric_memory(self._unit, _made_together(self._unit), backend)

    # -- state dict and module moves -------------------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, except that a missing key (with ``strict``) or a
        shape mismatch raises before anything is copied, naming the key: torch's own
        load copies every entry that fits first and leaves a half-loaded model."""
        check_fits(self, state_dict, "", strict, self._unit.name)
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


# -- what the setters share -------------------------------------------------------------

def _units(module: FSDPModule, recurse: bool) -> list[UnitState]:
    """The units a setter applies to: those under ``module``, or (without ``recurse``)
    its unit and the others its fully_shard call made (a list shares one group; split-off
    companions, Note [parameters on meshes of their own])."""
    if not recurse:
        return _made_together(module._unit)
    return [m._unit for m in module.modules()  # type: ignore[attr-defined]
            if isinstance(m, FSDPModule)]


def _made_together(unit: UnitState) -> list[UnitState]:
    return [*unit.created_with, *unit.companions]


def _set_flag(module: FSDPModule, flag: str, value: bool, recurse: bool) -> None:
    """Set a boolean run-time toggle on the module's unit (and sharded submodules)."""
    _expect_bool(f"set_{flag}", value)
    for unit in _units(module, recurse):
        setattr(unit, flag, value)


def _check_not_merged(unit: UnitState, method: str, what: str) -> None:
    """Units merged with others into one collective cannot differ from them."""
    root = unit.root
    if root is not None and unit.group is not None:
        others = [u.name for u in root.members[unit.batch] if u not in unit.created_with]
        if others:
            raise ValueError(
                f"{method} on {unit.name}: its parameters were merged with "
                f"{', '.join(others)} into one collective at the first forward, so its "
                f"{what} cannot differ from theirs. Call it right after "
                "fully_shard (before the first forward), or turn merging off with "
                "root.set_bucket_numel(0) then.")


def _set_reduce(unit: UnitState, method: str, **changes) -> None:
    """Change the unit's reduction settings (with its fully_shard call's other units)."""
    _check_not_merged(unit, method, "gradient reduction")
    for u in _made_together(unit):
        u.reduce_options = dataclasses.replace(u.reduce_options, **changes)


def _set_comm(unit: UnitState, method: str, attr: str, comm) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(f"{method} on {unit.name}: expected a torch.distributed.fsdp "
                        "Comm (an object with allocate(size, *, dtype, device) that is "
                        f"called to run the collective), got {type(comm).__name__}.")
    _check_not_merged(unit, method, "collective")
    if unit.group is not None:
        setattr(unit.group, attr, comm)


def _prefetch_targets(method: str, modules) -> list[UnitState]:
    targets = []
    for i, m in enumerate(modules):
        if not isinstance(m, FSDPModule):
            raise ValueError(f"{method}: modules[{i}] ({type(m).__name__}) is not sharded; "
                             "pass modules that fully_shard was applied to.")
        targets.append(m._unit)
    return targets


def _set_quantized(unit: UnitState, units: list[UnitState], weights: bool, grads: bool,
                   block_size: int) -> None:
    """``set_quantized_communication`` on ``unit``, applied to ``units``."""
    method = "set_quantized_communication"
    _expect_bool(method, weights)
    _expect_bool(method, grads)
    if isinstance(block_size, bool) or not isinstance(block_size, int) \
            or block_size < 32 or block_size % 32:
        raise ValueError(f"{method} on {unit.name}: block_size must be a positive "
                         f"multiple of 32 (elements per scale), got {block_size!r}.")
    for u in units:
        _check_quantizable(u, units, weights, grads)
    for u in units:
        for group in {u.group, u.batch} - {None}:  # after lazy init, its batch's too
            group.quantize_weights = block_size if weights else 0
            group.quantize_grads = block_size if grads else 0


def _check_quantizable(unit: UnitState, changing: list[UnitState], weights: bool,
                       grads: bool) -> None:
    """Errors for set_quantized_communication on ``unit`` that cannot hold (E141)."""
    group = unit.group
    if group is None or not (weights or grads):
        return
    where = f"set_quantized_communication on {unit.name}"
    for asked, what, comm, custom in (
            (weights, "weights=True", group.all_gather_comm, "set_custom_all_gather"),
            (grads, "grads=True", group.reduce_scatter_comm, "set_custom_reduce_scatter")):
        if asked and comm is not None:
            raise ValueError(f"{where}: {what} and {custom} both replace the unit's "
                             "collective; use one of them.")
    if group.world_size == 1 and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{where}: the unit is not sharded (NO_SHARD: a shard group of one "
                         "rank, replicas all-reduced), so there is no all-gather or "
                         "reduce-scatter to quantize. Shard it (FULL_SHARD, SHARD_GRAD_OP, "
                         "HYBRID_SHARD) or leave quantization off.")
    root = unit.root
    if root is not None:
        others = [u.name for u in root.members[unit.batch] if u not in changing]
        if others:
            raise ValueError(f"{where}: its parameters were merged with {', '.join(others)} "
                             "into one collective at the first forward, so its communication "
                             "cannot differ from theirs. Call it before the first forward, or "
                             "on a module that contains them all.")


def _expect_bool(method: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}: expected a bool, got {type(value).__name__}")


def _on_stream(hook: Callable, stream, device_module) -> Callable:
    """``hook`` run on ``stream``, which first waits for the current stream; the current
    stream then waits for it (torch's ``set_all_reduce_hook(hook, stream=...)``)."""
    def run(output: torch.Tensor) -> None:
        current = device_module.current_stream()
        stream.wait_stream(current)
        with device_module.stream(stream):
            hook(output)
        current.wait_stream(stream)
    return run


def _no_copy_message(module: nn.Module, what: str) -> str:
    name = type(module)._fullshard_original_class.__name__
    return (f"{what} of a sharded {name} is not supported: its "
            "parameters are shards tied to this process group. Copy the state instead: "
            "build another model, fully_shard it, and load this one's state_dict() (or save "
            "it with fullshard.checkpoint / torch.distributed.checkpoint).")
