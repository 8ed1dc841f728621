"""Optimizer steps on the local shards, without DTensor dispatch.

Note [optimizer steps on local shards]
Sharded parameters are DTensors so that ``torch.optim``, ``clip_grad_norm_`` and
DCP work unchanged. But every tensor op on a DTensor goes through DTensor's
dispatcher: AdamW on a 32-layer model issues ~3,100 such ops per step and spent
61 ms there where the same math on plain tensors took 14 ms. For optimizers whose
update is elementwise (the parameter, its gradient and its states combine entry
by entry, so a shard can be updated alone), fullshard hooks ``Optimizer.step``:
just before the step, each fullshard parameter in ``param_groups`` is swapped for
its local shard (a plain tensor viewing the same memory), its ``.grad`` for the
local gradient and its state for the states' local tensors; right after the
step everything is swapped back, and states the step created are wrapped as
DTensors. Outside ``step()`` the optimizer sees DTensors, as in FSDP2.

Optimizers that need whole matrices (``torch.optim.Muon``, or any class declared with
``register_whole_matrix_optimizer``) step each parameter whole on one rank (Note
[whole-matrix optimizers] in whole_matrix/__init__.py). Other optimizers that reduce over a
whole parameter (LAMB/LARS trust ratios, any subclass) are left alone: they keep the
DTensor path. torch optimizers whose implementation fails on DTensor shards (SparseAdam,
LBFGS over an unevenly sharded parameter) are refused at their first step, naming the
ones that work.

Which call of ``step()`` swaps (the outermost, not a subclass's ``super().step()``), how a
step that raises is undone, and how a step runs several times within one ``step()`` with
the hooks around the whole: Note [the calls of an optimizer step] in step_calls.py.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import increment_version
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .core.param import SHARDED_ORIGINALS, any_tracked, on_first_track, owner_of, stale_owner
from .core.features.mapped import page_out
from .core.state import finish_all_pending_reduces, finish_host_steps
from .offload import step_on_disk
from .policies import DiskOffloadPolicy
from . import step_calls, whole_matrix

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD,
)

# torch optimizers that cannot step sharded parameters, and why: refused at their first
# step, naming the optimizers that can (the others run on the DTensors, as in FSDP2).
_CANNOT_STEP_SHARDS: dict[str, str] = {
    "SparseAdam": "it needs sparse gradients, and sharded gradients are dense DTensors",
}

# The process-wide switch behind set_local_step (a debugging aid: the DTensor path).
_enabled = True
# What the pre-step hook swapped, per optimizer, until the post-step hook restores it.
# Keyed weakly: this module must not keep a user's optimizer alive.
_SWAPPED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()
# What a whole-matrix step swapped in (whole_matrix.before), per optimizer, until after it.
_WHOLE: "weakref.WeakKeyDictionary[torch.optim.Optimizer, whole_matrix.WholeStep]" = \
    weakref.WeakKeyDictionary()
# Per optimizer that has taken its first step (whose checks passed): whether it needs
# whole matrices. Its class decides that once, at the first step, rather than a walk over
# the registered classes at every step; register_whole_matrix_optimizer therefore applies
# to optimizers that first step after it.
_NEEDS_WHOLE: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = \
    weakref.WeakKeyDictionary()


def set_local_step(enabled: bool) -> None:
    """Turn the local-shard optimizer step on (default) or off (pure DTensor path)."""
    global _enabled
    _enabled = enabled


def local_step_enabled() -> bool:
    """Whether optimizers step the local shards (``set_local_step``)."""
    return _enabled


def _place(i: int, j: int) -> str:
    """Where an optimizer holds a parameter, as its messages name it."""
    return f"param_groups[{i}]['params'][{j}]"


def _owner_for_step(opt: torch.optim.Optimizer, p: torch.Tensor, i: int, j: int):
    """The ShardedParam behind optimizer parameter ``p``, ``param_groups[i]['params'][j]``
    (None for other tensors), after checking the invariant of Note [one storage is the
    shard]: ``p`` is the parameter the model holds and its local tensor is the shard the
    all-gather sends. The place is formatted only for an error: this runs for every
    parameter at every step."""
    owner = owner_of(p)
    if owner is None:
        stale = stale_owner(p)
        if stale is None:
            return None
        raise RuntimeError(
            f"fullshard: {type(opt).__name__} {_place(i, j)} is parameter '{stale.fqn}' as it was "
            "before the module replaced it (load_state_dict(assign=True) or a reassignment "
            "installs a new tensor): stepping it would no longer change the model. Create "
            "the optimizer after such a load and load its state then, or load without "
            "assign=True, which copies into the existing parameters.")
    if owner.extension is not None and not owner.sharded_param.requires_grad:
        raise RuntimeError(
            f"fullshard: {type(opt).__name__} {_place(i, j)} is parameter '{owner.fqn}', a frozen "
            f"{type(owner.sharded_param._local_tensor).__name__} weight that gathers through "
            "its tensor subclass (a quantized base); an optimizer must not hold it. Build "
            "the optimizer over the trainable parameters only: "
            "[p for p in model.parameters() if p.requires_grad].")
    if not owner.local_is_shard():
        raise RuntimeError(
            f"fullshard: parameter '{owner.fqn}': the tensor {type(opt).__name__} updates is no "
            "longer the shard its unit all-gathers (its local tensor was replaced outside "
            "fullshard), so training would silently stop reaching the model. Change "
            "parameter values in place (param.copy_(...) under torch.no_grad()) or through "
            "model.load_state_dict / set_model_state_dict.")
    return owner


def _pre_step(opt: torch.optim.Optimizer, args, kwargs):
    if not any_tracked() or step_calls.is_alone(opt):
        return None  # no fullshard parameter at all, or a step inside fullshard's own
    if not step_calls.enter(opt):
        return None  # an override's super().step(): the outer step's hooks do the work
    _restore(opt)  # a step that raised on another thread left its swap behind
    needs_whole = _NEEDS_WHOLE.get(opt)
    if needs_whole is None:  # its first step
        _check_not_built_before_sharding(opt)
        _check_can_step_shards(opt)
        needs_whole = _NEEDS_WHOLE[opt] = whole_matrix.needs_whole_matrices(opt)
    owners = [[_owner_for_step(opt, p, i, j) for j, p in enumerate(group["params"])]
              for i, group in enumerate(opt.param_groups)]
    if any(o is not None for group in owners for o in group):
        step_calls.guard(opt, _restore)  # undoes the swap of a step that raises
    # a step of these parameters overlapped with the forward (overlapped_step.py) ends first
    finish_host_steps(o for group in owners for o in group if o is not None)
    if needs_whole and any(o is not None for g in owners for o in g):
        replaced = _run_closure_first(args, kwargs)
        finish_all_pending_reduces()
        _WHOLE[opt] = whole_matrix.before(
            opt, owners, step_calls.step_alone if whole_matrix.steps_each_alone(opt) else None)
        return replaced
    swapping = (_enabled and type(opt) in ELEMENTWISE_OPTIMIZERS
                and any(o is not None for group in owners for o in group))
    disk_policy = [(p, o) for group, group_owners in zip(opt.param_groups, owners)
                   for p, o in zip(group["params"], group_owners)
                   if o is not None and isinstance(o.offload, DiskOffloadPolicy)]
    if disk_policy and not swapping:
        _refuse_disk_states(opt, disk_policy[0][1])
    on_disk = [(p, o) for p, o in disk_policy if states_on_disk(o)]
    replaced = _run_closure_first(args, kwargs) if swapping else None
    finish_all_pending_reduces()  # gradients left in flight by set_is_last_backward(False)
    if not swapping:
        return replaced
    if on_disk:  # Note [optimizer states on disk]: these step first, a chunk at a time
        step_on_disk(opt, on_disk,
                     lambda: step_calls.step_alone(opt))
    swaps = []
    for group, group_owners in zip(opt.param_groups, owners):
        params = group["params"]
        local_params = []
        swapped = False
        for p, owner in zip(params, group_owners):
            if states_on_disk(owner):
                swapped = True  # stepped above; the ordinary step must not see it
                continue
            local = _local_view(p) if owner is not None else None
            if local is None:
                local_params.append(p)
                continue
            grad = p.grad
            if grad is not None and grad.dtype != local.dtype:  # Note [a parameter's grad_dtype]
                local.grad_dtype = grad.dtype
            local.grad = grad._local_tensor if grad is not None else None
            state = opt.state.pop(p, None)
            local_state = local_states(state)
            if local_state:
                opt.state[local] = local_state
            swaps.append((p, local, state, local_state and tuple(local_state.values())))
            local_params.append(local)
            swapped = True
        if swapped:
            swaps.append((group, params, None, None))
            group["params"] = local_params
    if swaps:
        _SWAPPED[opt] = swaps
    return replaced


def states_on_disk(owner) -> bool:
    """Whether the parameter behind ``owner`` (None: not fullshard's) steps on disk. An
    empty shard (fewer rows than ranks) has no element to keep there: it steps with the
    ordinary step, so its states exist (empty) on this rank as on the others and state
    dicts hold the same keys on every rank."""
    return (owner is not None and isinstance(owner.offload, DiskOffloadPolicy)
            and owner.sharded_param._local_tensor.numel() > 0)


def _run_closure_first(args, kwargs):
    """``step(closure)`` (Lightning's automatic optimization) runs forward and backward
    inside the step, after this hook; the swap below would hand the optimizer local
    tensors whose gradients that backward never fills. The elementwise optimizers call
    the closure exactly once, first, under ``enable_grad``; so run it here, the same
    way, and give the step a closure that returns its loss."""
    # torch hands step's own arguments over with the optimizer first: (opt, closure?)
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None
    with torch.enable_grad():
        loss = closure()
    done = lambda: loss  # noqa: E731 - the step's closure, now returning the result
    if "closure" in kwargs:
        return args, {**kwargs, "closure": done}
    return (args[0], done, *args[2:]), kwargs


def _check_not_built_before_sharding(opt: torch.optim.Optimizer) -> None:
    for i, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            unit = SHARDED_ORIGINALS.get(p)
            if unit is not None:
                raise RuntimeError(
                    f"fullshard: {type(opt).__name__} {_place(i, j)} (shape "
                    f"{tuple(p.shape)}) is a parameter that fully_shard({unit}) replaced by a "
                    "sharded DTensor: the optimizer was created before fully_shard and would "
                    "update a tensor the model no longer uses. Create the optimizer after "
                    "sharding: fully_shard(...) first, then torch.optim.X(model.parameters()).")


def _check_can_step_shards(opt: torch.optim.Optimizer) -> None:
    """Refuse, at the first step, a torch optimizer that fails on sharded parameters
    (inside torch, with a DTensor error that names neither the optimizer nor a remedy)."""
    params = [p for group in opt.param_groups for p in group["params"]
              if owner_of(p) is not None]
    if not params:
        return
    name = next((t.__name__ for t in type(opt).__mro__ if t.__name__ in _CANNOT_STEP_SHARDS
                 and t.__module__.startswith("torch.optim")), None)
    why = _CANNOT_STEP_SHARDS.get(name)
    if name is None and isinstance(opt, torch.optim.LBFGS):
        uneven = next((owner_of(p) for p in params
                       if any(getattr(pl, "dim", None) is not None
                              and p.shape[pl.dim] % p.device_mesh.size() != 0
                              for pl in p.placements)), None)
        if uneven is not None:
            name, why = "LBFGS", (
                f"it flattens every parameter into one vector, which DTensor allows only "
                f"for evenly sharded ones, and '{uneven.fqn}' {tuple(uneven.sharded_param.shape)} "
                f"splits unevenly over {uneven.sharded_param.device_mesh.size()} ranks")
    if why is None:
        return
    local = ", ".join(t.__name__ for t in ELEMENTWISE_OPTIMIZERS)
    raise RuntimeError(
        f"fullshard: {type(opt).__name__} cannot step sharded parameters: {why}. fullshard "
        f"steps {local} on each rank's shard; other optimizers run on the DTensor "
        "parameters, as in torch's FSDP2, where their implementation supports DTensors. "
        "Use one of those.")


def _local_view(p: DTensor) -> torch.Tensor | None:
    grad = p.grad
    if grad is not None and (not isinstance(grad, DTensor)
                             or grad._local_tensor.shape != p._local_tensor.shape):
        return None
    return p._local_tensor


def _post_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
    if step_calls.is_alone(opt) or not step_calls.leave(opt):
        return  # a step inside fullshard's own, or the end of a nested call
    whole = _WHOLE.pop(opt, None)
    if whole is not None:
        whole_matrix.after(opt, whole)
    _restore(opt)
    _mark_stepped(opt)


def _mark_stepped(opt: torch.optim.Optimizer) -> None:
    """Count the step as a write to each shard it updated, also where the optimizer wrote
    through ``.data`` (which autograd does not count), so that parameters kept gathered
    across it are gathered again (Note [parameters kept gathered across backward]);
    and give back the pages the step touched of parameters kept on disk (Note [parameters
    on disk]: the disk step gives back its chunks as it goes, the rest go here)."""
    if not any_tracked():
        return
    stepped = []  # one call raises every counter: a call per parameter was most of this
    for group in opt.param_groups:
        for p in group["params"]:
            owner = owner_of(p)
            if owner is None:
                continue
            if p.grad is not None:  # what torch's optimizers step
                stepped.append(p._local_tensor)
            if getattr(owner.offload, "params", False):
                page_out(p._local_tensor)
    if stepped:
        increment_version(stepped)


def _refuse_disk_states(opt: torch.optim.Optimizer, owner) -> None:
    why = ("set_local_step(False) is in effect" if not _enabled else
           f"{type(opt).__name__} is not one of the elementwise optimizers ("
           + ", ".join(t.__name__ for t in ELEMENTWISE_OPTIMIZERS) + ")")
    raise RuntimeError(
        f"fullshard: {type(opt).__name__} steps parameter '{owner.fqn}', whose unit keeps "
        f"optimizer states on disk (DiskOffloadPolicy(path={owner.offload.path!r})), but "
        f"{why}: states on disk are stepped a chunk of elements at a time, which only an "
        "elementwise update allows. Use such an optimizer, or CPUOffloadPolicy() for this unit.")


def _restore(opt: torch.optim.Optimizer) -> None:
    whole = _WHOLE.pop(opt, None)
    if whole is not None:  # a whole-matrix step that raised: its parameters are as they were
        whole_matrix.undo(opt, whole)
    swaps = _SWAPPED.pop(opt, None)
    if not swaps:
        return
    for first, second, state, local_values in swaps:
        if isinstance(first, dict):  # (param_group, original params list)
            first["params"] = second
            continue
        p, local = first, second
        local.grad = None
        after = state_after_step(p, opt.state.pop(local, None), state, local_values)
        if after:
            opt.state[p] = after


def local_states(state: dict | None) -> dict | None:
    """A parameter's optimizer states with each DTensor replaced by its local tensor (the
    memory the local-shard step updates); None for no states."""
    if not state:
        return None
    return {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state.items()}


def state_after_step(p: DTensor, new: dict | None, old: dict | None,
                     old_local_values: tuple | None) -> dict | None:
    """What ``opt.state[p]`` holds after a local-shard step that left ``new`` for ``p``'s
    local tensor, given the states ``old`` it had and their local tensors: ``old`` where
    the step updated them in place (every step after the first), the states the step
    made wrapped as DTensors otherwise."""
    if new and old_local_values is not None and len(new) == len(old_local_values) \
            and all(a is b for a, b in zip(new.values(), old_local_values)):
        return old
    if new:
        return _as_dtensor_state(p, new, old or {})
    return old


def _as_dtensor_state(p: DTensor, new: dict, old: dict) -> dict:
    """States updated in place keep their DTensor; states the step created are wrapped."""
    out = {}
    for k, v in new.items():
        prev = old.get(k)
        if isinstance(prev, DTensor) and prev._local_tensor is v:
            out[k] = prev
        elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p._local_tensor.shape \
                and v.dtype == p.dtype:
            out[k] = DTensor(v, p._spec, requires_grad=False)
        else:
            out[k] = v
    return out


def _install() -> None:
    register_optimizer_step_pre_hook(_pre_step)
    register_optimizer_step_post_hook(_post_step)


# Installed once, by the first fully_shard (importing fullshard installs nothing): torch
# offers per-optimizer hooks only on optimizers we never see being built. Both hooks
# touch nothing but fullshard's own sharded parameters (those the registry in
# core/param.py holds); an optimizer with none of them is left exactly as it was.
on_first_track(_install)
