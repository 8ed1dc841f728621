"""The offloaded optimizer step on a host thread, overlapped with the next forward.

Note [the host step overlapped with the next forward]
Under CPU offload the optimizer steps the shards on the host after backward. On a GPU that
host work (an fp32 AdamW reads and writes ~28 bytes per parameter) takes longer than the
forward and backward together, and the device idles through it. ``OverlappedStep(opt)``
lets the device go on: its ``step()`` steps the parameters that live on the device at
once, through ``opt.step()`` (the optimizer's hooks run once, as usual), hands each
offloaded unit's shards to one host thread, unit by unit in the order forward gathers
them, and returns. The next forward starts at once; each offloaded unit's gather waits for
that unit's step alone (``ParamGroup.finish_host_step``), so the first blocks compute while
the host steps the later ones. Units whose optimizer states are on disk go the same way,
their states streamed through the files unit by unit (Note [the disk step on the host
thread] in offload/optimizer_states.py).

Exact: the values are those ``opt.step()`` gives, bit for bit. An elementwise optimizer
(``ELEMENTWISE_OPTIMIZERS``) updates each parameter from its own gradient and states
alone, so stepping the parameters in pieces, with the hyperparameters, ``grad_scale`` and
``found_inf`` as they were when ``step()`` was called, changes no value.

What waits for the steps in flight: a gather of the unit (forward, ``unshard()``), the
next gradients written into the unit (backward), ``state_dict`` and ``load_state_dict`` of
the optimizer and of the sharded modules (checkpoints go through them), any optimizer
step, and ``wait()``. What cannot wait by itself: code that reads a parameter's values or
an optimizer state directly between ``step()`` and the next forward (an EMA of the
weights, a norm of the parameters): call ``wait()`` first. The gradients of the
parameters stepped on the host are handed to the step: their ``.grad`` is None after
``step()`` (as after the ``zero_grad()`` that follows a step), so nothing can change them
while the host reads them. An error on the host thread is raised at the next wait.

Note [the host step overlapped with backward]
Without a gradient clip nothing after backward changes an offloaded unit's gradients, so
its step need not wait for the end of backward either: inside ``with
overlapped.stepping_in_backward(): loss.backward()`` each offloaded unit (CPU or disk) is
handed to the host thread as soon as its reduced gradients are handed out
(``RootState._finish`` tells ``BackwardState.on_reduced``), while backward goes on with the
units before it; the host thread first waits for that unit's copy to the host
(``HostCopies.landed``).
``step()`` then steps what is left. The same bits as ``optimizer.step()``: the
hyperparameters are those the optimizer holds during backward, which is what ``step()``
would read as long as nothing changes them in between (schedulers step after
``step()``). What it cannot serve, and refuses: a clip or a GradScaler (``grad_scale`` /
``found_inf`` on the optimizer), whose coefficient exists only after every gradient.
A unit whose parameters lacked a gradient on every rank (their ``.grad`` becomes None
only when backward settles) and gradients left in flight by
``set_is_last_backward(False)`` are stepped by ``step()``, as before. Every backward in
the block with gradient sync steps: put only the last micro-batch's backward in it (the
earlier ones under ``set_requires_gradient_sync(False)`` reduce nothing and step nothing).

``delayed=True`` stops the next forward from waiting at all, one step stale (Note [the
delayed update] in delayed_update.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.autograd.graph import increment_version

from .core.group import ParamGroup
from .core.param import owner_of
from .core.hooks import ensure_root
from .core.state import (finish_all_pending_reduces, finish_host_steps, groups_in_order,
                         live_roots, units_in)
from .delayed_update import (check_delay_after, distinct, load_pending, pending_views,
                             read_copies_of, refuse_disk_offload, stop_delayed_read)
from .offload import disk_states
from .optim import (ELEMENTWISE_OPTIMIZERS, _local_view, local_states, state_after_step,
                    states_on_disk)
from .step_calls import step_alone
from . import optim

# the flags a fused step reads from its optimizer (the trainer's clip, a GradScaler)
_STEP_FLAGS = ("grad_scale", "found_inf")


class _Listened(NamedTuple):
    """A group whose reduction steps it during backward (Note [the host step overlapped
    with backward]), and its parameters in the optimizer as (param group index, parameter)."""
    group: ParamGroup
    work: list


# modules whose state_dict / load_state_dict already wait for host steps
_WAITING_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class OverlappedStep:
    """Step ``optimizer`` with its offloaded parameters (CPU or disk) stepped on a host
    thread while the next forward runs (Note [the host step overlapped with the next
    forward]).

    ``step()`` replaces ``optimizer.step()``; everything else (``zero_grad``, LR schedulers,
    ``state_dict``) stays with ``optimizer``. ``wait()`` finishes the steps in flight.

    ``delayed=True``: ZeRO-Offload's one-step delayed update, after ``delay_after`` exact
    steps (Note [the delayed update]): the next forward and backward compute with the
    offloaded units' parameters as they were before the update in flight, and wait for
    nothing. A resume restores ``delayed_state_dict()`` too."""

    def __init__(self, optimizer: torch.optim.Optimizer, delayed: bool = False,
                 delay_after: int = 0):
        if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
            names = ", ".join(t.__name__ for t in ELEMENTWISE_OPTIMIZERS)
            raise TypeError(
                f"fullshard.OverlappedStep: {type(optimizer).__name__} is not one of the "
                f"elementwise optimizers ({names}), whose step can run a unit at a time on "
                "a host thread with the same result. Call optimizer.step() for it.")
        check_delay_after(delay_after, delayed)
        if delayed:
            refuse_disk_offload(optimizer)
        self.optimizer = optimizer
        self.delayed, self.delay_after = bool(delayed), delay_after
        self.steps = 0  # step() calls: the first delay_after are exact
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fullshard-host-step")
        weakref.finalize(self, self._pool.shutdown, wait=True)
        self._groups: list[ParamGroup] = []  # those given a host step by the last step()
        # Note [the host step overlapped with backward]: groups handed to the host thread
        # during this backward, and their parameters (step() leaves them alone)
        self._from_backward: list[ParamGroup] = []
        self._stepped_in_backward: set[int] = set()
        # id(parameter) -> the gradient handed to the host thread with it, until step()
        self._handed: dict[int, torch.Tensor] = {}
        # in the block: id(ShardedParam) -> its group and that group's work
        self._listening: dict[int, _Listened] | None = None
        # in the block: the DiskStates and index of each parameter whose states are on disk
        self._stores: dict[int, tuple] = {}
        optimizer.register_state_dict_pre_hook(lambda _opt: self.wait())
        optimizer.register_load_state_dict_pre_hook(lambda _opt, _state: self.wait())

    def step(self, closure=None) -> None:
        """What ``optimizer.step()`` does, with the offloaded units stepped on the host
        thread; returns once they are handed to it."""
        if closure is not None:
            raise ValueError(
                "fullshard.OverlappedStep.step: a closure re-runs forward and backward "
                "inside the step, which leaves nothing to overlap; call optimizer.step("
                "closure) instead.")
        self._wait(self._groups)  # the last step's; this backward's run on
        opt = self.optimizer
        if not optim.local_step_enabled():
            if self.delayed:
                raise RuntimeError(
                    "fullshard.OverlappedStep(delayed=True).step: set_local_step(False) "
                    "steps every parameter as a DTensor in optimizer.step(), which leaves "
                    "nothing to delay; turn local steps back on, or drop delayed=True.")
            opt.step()  # the DTensor path (set_local_step(False)) steps everything here
            return
        finish_all_pending_reduces()  # every gradient final and on the host
        self.steps += 1
        on_host = _host_stepped(opt)
        delays = self.delayed and self.steps > self.delay_after
        if self.delayed:  # Note [the delayed update]: copies only of units stepped now
            read_copies_of(on_host if delays else {}, groups_in_order()[0])
        # Note [the disk step on the host thread]: every parameter whose states are on
        # disk leaves the device step, stepped on the host or (no gradient) not at all
        stores = _disk_stores(opt)
        moved = self._stepped_in_backward | {id(p) for work in on_host.values()
                                             for _i, p in work} | set(stores)
        self._groups, self._from_backward = self._from_backward, []
        self._stepped_in_backward, self._handed = set(), {}
        if not moved:
            opt.step()
            return
        kept = [group["params"] for group in opt.param_groups]
        try:  # the optimizer's own step, hooks and all, over what stays on the device
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in moved]
            opt.step()
        finally:
            for group, params in zip(opt.param_groups, kept):
                group["params"] = params
        hyper, flags = _as_step_sees_them(opt)
        for group, work in on_host.items():
            self._groups.append(self._hand_to_host(group, work, hyper, flags, None, stores))

    def catch_up(self) -> None:
        """Finish the host steps and drop the copies: the next forward computes with the
        parameters as updated, as after an exact step (Note [the delayed update])."""
        self.wait()
        groups, _order = groups_in_order()
        for group in distinct(groups.values()):
            group.stop_delayed_read()

    def delayed_state_dict(self) -> dict:
        """What a resume needs besides the module's and the optimizer's state dicts under
        ``delayed=True`` (Note [the delayed update]): the step count, and the copies the
        next forward computes with, as DTensors shaped like the parameters (keys
        ``"param group index.position"`` in the optimizer)."""
        groups, _order = groups_in_order()
        return {"steps": self.steps, "pending": pending_views(self.optimizer, groups)}

    def load_delayed_state_dict(self, state: dict, model: nn.Module) -> None:
        """Restore ``delayed_state_dict()``: call it after loading ``model`` (the
        ``fully_shard`` root holding the optimizer's parameters; loading it drops the
        copies) and the optimizer. Sets ``model``'s units up if no forward has yet."""
        self.wait()
        units = units_in(model)
        if units:
            ensure_root(units[0])  # made, the root batches its units as a first forward would
        groups, _order = groups_in_order()
        load_pending(self.optimizer, groups, state["pending"])
        self.steps = int(state["steps"])

    @contextlib.contextmanager
    def stepping_in_backward(self):
        """Step each offloaded unit (CPU or disk) on the host thread as soon as a backward
        run in this block hands out its gradients, rather than at ``step()`` (Note [the host step
        overlapped with backward]); ``step()`` afterwards steps the rest. For runs without
        a clip or GradScaler only."""
        opt = self.optimizer
        if self.delayed:
            raise ValueError(
                "fullshard.OverlappedStep.stepping_in_backward: delayed=True hands each "
                "unit out in step(), after copying the parameters the next forward reads; "
                "call loss.backward() outside stepping_in_backward() with delayed=True.")
        flags = [name for name in _STEP_FLAGS if getattr(opt, name, None) is not None]
        if flags:
            raise ValueError(
                f"fullshard.OverlappedStep.stepping_in_backward: the optimizer has "
                f"{' and '.join(flags)} set, a clip or loss-scale coefficient known only "
                "after the whole backward, which a unit stepped during backward cannot "
                "apply. Clear them, or call step() after backward for clipped runs.")
        if self._listening is not None:
            raise RuntimeError("fullshard.OverlappedStep.stepping_in_backward: already "
                               "inside stepping_in_backward(); the blocks do not nest.")
        if not optim.local_step_enabled():
            yield  # the DTensor path steps everything in step()
            return
        self._stores = _disk_stores(opt)
        roots, self._listening = _listen_on_roots(opt, self._on_reduced)
        try:
            yield
        finally:
            for root in roots:
                root.backward.on_reduced = None
            self._listening, self._stores = None, {}

    def gradients_of(self, params) -> list[torch.Tensor | None]:
        """Each of ``params``' gradient: its ``.grad``, or for a parameter stepped in a
        ``stepping_in_backward()`` block since the last ``step()``, the gradient handed to
        the host thread with it (its ``.grad`` is None then); None where it has neither.
        For a gradient norm over the whole model after such a backward (the host step only
        reads the gradients: they keep their values)."""
        return [p.grad if p.grad is not None else self._handed.get(id(p)) for p in params]

    def _on_reduced(self, params: list, all_present: bool) -> None:
        """A reduction handed out gradients (core/state.py): step its unit now if it is
        offloaded and every parameter got a gradient."""
        listened = self._listening.get(id(params[0])) if params else None
        if listened is None or not all_present:
            return
        opt = self.optimizer
        group = listened.group
        work = [(index, p) for index, p in listened.work
                if p.grad is not None and _local_view(p) is not None
                and id(p) not in self._stepped_in_backward]
        if not work:
            return
        if any(getattr(opt, name, None) is not None for name in _STEP_FLAGS):
            raise ValueError("fullshard.OverlappedStep.stepping_in_backward: grad_scale or "
                             "found_inf was set on the optimizer during backward; a unit "
                             "stepped during backward cannot apply them.")
        group.finish_host_step()  # a step of it still running from before
        hyper, flags = _as_step_sees_them(opt)
        self._stepped_in_backward.update(id(p) for _i, p in work)
        self._handed.update((id(p), p.grad) for _i, p in work)  # for gradients_of
        self._from_backward.append(self._hand_to_host(
            group, work, hyper, flags, group.copies.landed(), self._stores, backward=True))

    def _hand_to_host(self, group: ParamGroup, work: list, hyper: list, flags: dict,
                      ready, stores: dict | None = None, backward: bool = False) -> ParamGroup:
        """Give ``work`` (the unit's (param group index, parameter) pairs) to the host
        thread, their gradients with them; ``stores``: the DiskStates and index of each
        parameter whose states are on disk, by id; ``backward``: handed out in backward's
        order (the files read ahead toward the unit before)."""
        opt = self.optimizer
        items = []
        disk: dict = {}  # DiskStates -> {parameter index: local gradient}
        groups: dict = {}  # DiskStates -> {parameter index: its index among param_groups}
        for index, p in work:
            grad = p.grad
            p.grad = None  # handed to the host step: nothing may change it meanwhile
            store = stores.get(id(p)) if stores else None
            if store is not None:
                disk.setdefault(store[0], {})[store[1]] = grad._local_tensor
                groups.setdefault(store[0], {})[store[1]] = index
                continue
            items.append((index, p, p._local_tensor, grad._local_tensor, opt.state.get(p)))
        chunks = []
        for states, grads in disk.items():
            states.hand_over(opt, grads)
            unit = states.chunks_of(sorted(grads))
            chunks.append((states, unit, grads, states.previous_unit(unit) if backward else None,
                           groups[states]))
        group.host_step = self._pool.submit(_step_group, opt, items, chunks, hyper, flags,
                                            group.unit_name, ready)
        _wait_in_state_dicts(group)
        return group

    def wait(self) -> None:
        """Finish the host steps in flight; an error one of them raised is raised here."""
        self._wait(self._groups)
        self._wait(self._from_backward)

    @staticmethod
    def _wait(groups: list[ParamGroup]) -> None:
        """Finish the host steps of ``groups`` (emptied as they finish: an error leaves the
        rest to the next wait)."""
        while groups:
            groups.pop(0).finish_host_step()

    def __getattr__(self, name: str):
        # zero_grad, param_groups, state, ...: the optimizer's own
        if name == "optimizer":  # not set yet: __init__ refused the optimizer
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def _listen_on_roots(opt: torch.optim.Optimizer, listener
                     ) -> tuple[list, dict[int, _Listened]]:
    """Tell every root holding an offloaded parameter of ``opt`` (CPU or disk) to call
    ``listener`` as reductions hand out gradients; the roots, and each listened group with
    its parameters in ``opt`` by the id of every ShardedParam of the group."""
    groups, _order = groups_in_order()
    work_of: dict[ParamGroup, list] = {}
    for index, param_group in enumerate(opt.param_groups):
        for p in param_group["params"]:
            owner = owner_of(p)
            group = groups.get(id(owner)) if owner is not None else None
            if group is not None and owner.offload is not None:
                work_of.setdefault(group, []).append((index, p))
    listened = {id(sharded): _Listened(group, work)
                for group, work in work_of.items() for sharded in group.params}
    roots = [root for root in live_roots() if any(group in root.members for group in work_of)]
    for root in roots:
        root.backward.on_reduced = listener
    return roots, listened


def _disk_stores(opt: torch.optim.Optimizer) -> dict[int, tuple]:
    """The DiskStates and index of each parameter of ``opt`` whose states are on disk, by
    id (made, or made again, for the parameters ``opt`` holds now)."""
    owners = ((p, owner_of(p)) for group in opt.param_groups for p in group["params"])
    on_disk = [(p, owner) for p, owner in owners if states_on_disk(owner)]
    if not on_disk:
        return {}
    return {id(p): (states, i) for states in disk_states(opt, on_disk)
            for i, p in enumerate(states.params)}


def _as_step_sees_them(opt: torch.optim.Optimizer) -> tuple[list[dict], dict]:
    """The hyperparameters of each param group and the step flags, frozen as now."""
    hyper = [{k: _frozen(v) for k, v in group.items() if k != "params"}
             for group in opt.param_groups]
    flags = {name: _frozen(getattr(opt, name)) for name in _STEP_FLAGS
             if getattr(opt, name, None) is not None}
    return hyper, flags


def _host_stepped(opt: torch.optim.Optimizer) -> dict[ParamGroup, list]:
    """The parameters ``opt`` steps that a CPU- or disk-offloaded group holds, per group,
    groups in the order forward gathers them."""
    groups, order = groups_in_order()
    found: dict[ParamGroup, list] = {}
    for index, param_group in enumerate(opt.param_groups):
        for p in param_group["params"]:
            owner = owner_of(p)
            if owner is None or owner.offload is None or p.grad is None:
                continue
            if not states_on_disk(owner) and _local_view(p) is None:
                continue
            group = groups.get(id(owner))
            if group is not None:
                found.setdefault(group, []).append((index, p))
    return dict(sorted(found.items(), key=lambda item: order[item[0]]))


def _frozen(value):
    """``value`` as ``step()`` saw it: a tensor is copied, since a scheduler or scaler may
    change it in place (a tensor ``lr``, the scale) before the host thread reads it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _step_group(opt: torch.optim.Optimizer, items: list, disk: list, hyper: list[dict],
                flags: dict, unit_name: str, ready=None) -> None:
    """The host thread's work for one group: its CPU-offloaded parameters (``items``), then
    those whose states are on disk (``disk``: (DiskStates, chunks, gradients) each)."""
    if items or not disk:
        _step_unit(opt, items, hyper, flags, unit_name, ready)
    if disk:
        if ready is not None and not items:
            ready.synchronize()  # the gradients' copy to the host (_step_unit waits otherwise)
        _step_on_disk(opt, disk, hyper, flags, unit_name)


def _shadow(opt: torch.optim.Optimizer, hyper: list[dict], flags: dict, groups=None):
    """A copy of ``opt`` whose step sees only what its own ``param_groups`` and ``state``
    hold: the hyperparameters and step flags frozen at ``step()``, parameter group
    ``i`` empty unless ``groups`` says what it holds."""
    shadow = object.__new__(type(opt))
    shadow.__dict__.update(opt.__dict__)
    shadow.state = defaultdict(dict)
    shadow.param_groups = ([{**hyper[index], "params": params} for index, params in groups.items()]
                           if groups is not None else
                           [{**group, "params": []} for group in hyper])
    for name in _STEP_FLAGS:
        value = flags.get(name)
        setattr(shadow, name, None if value is None else value.cpu())
    return shadow


def _step_on_disk(opt: torch.optim.Optimizer, disk: list, hyper: list[dict], flags: dict,
                  unit_name: str) -> None:
    """Step a unit's parameters whose states are on disk, chunk by chunk, as
    ``DiskStates.step`` does inside ``opt.step()`` (Note [the disk step on the host thread]);
    ``disk``: (DiskStates, the unit's chunks, gradients, the chunk to read ahead, each
    parameter's index among the optimizer's param_groups) each."""
    try:
        for states, chunks, grads, then, groups in disk:
            shadow = _shadow(opt, hyper, flags)
            states.step_chunks(opt, shadow, lambda: step_alone(shadow), chunks, grads, then,
                               groups)
            increment_version([states.params[i]._local_tensor for i in grads])
    except Exception as error:
        raise RuntimeError(f"fullshard: the optimizer step of unit {unit_name} on the host "
                           f"thread (OverlappedStep) failed: {error}") from error


def _step_unit(opt: torch.optim.Optimizer, items: list, hyper: list[dict], flags: dict,
               unit_name: str, ready=None) -> None:
    """The host thread's work for one unit: ``opt``'s step over the unit's local shards,
    as a copy of ``opt`` whose groups hold only them (no hooks: they ran in ``step()``),
    once ``ready`` (the gradients' copy to the host, if in flight) has completed."""
    try:
        if ready is not None:
            ready.synchronize()
        by_group: dict[int, list] = {}
        handed = {}  # the local states handed to the step
        before = []  # per item: their values, to see what the step made
        for index, _p, local, grad, state in items:
            local.grad = grad
            by_group.setdefault(index, []).append(local)
            local_state = local_states(state)
            if local_state:
                handed[local] = local_state
            before.append(tuple(local_state.values()) if local_state else None)
        shadow = _shadow(opt, hyper, flags, by_group)
        shadow.state.update(handed)
        step_alone(shadow)
        for (_index, p, local, _grad, state), values in zip(items, before):
            local.grad = None
            after = state_after_step(p, shadow.state.get(local), state, values)
            if after is not None and after is not state:  # a first step made them
                opt.state[p] = after
            increment_version(local)  # also a write through .data counts (optim._mark_stepped)
    except Exception as error:
        raise RuntimeError(f"fullshard: the optimizer step of unit {unit_name} on the host "
                           f"thread (OverlappedStep) failed: {error}") from error


def _wait_in_state_dicts(group: ParamGroup) -> None:
    """Make the state dicts of the roots holding ``group`` wait for host steps first."""
    for root in live_roots():
        if group not in root.members:
            continue
        for unit in root.units:
            module = unit.module
            if module in _WAITING_MODULES:
                continue
            module.register_state_dict_pre_hook(lambda *_args: finish_host_steps())
            module.register_load_state_dict_pre_hook(lambda *_args: finish_host_steps())
            # loaded parameters are what the next forward computes with (Note [the
            # delayed update])
            module.register_load_state_dict_post_hook(stop_delayed_read)
            _WAITING_MODULES.add(module)
