"""The checker: torch's collectives wrapped so each is checked before it is issued.

Wrapping happens where every path meets: the methods of ``ProcessGroup`` that
``torch.distributed``'s functions call (so an alias such as ``_all_gather_flat =
dist.all_gather_into_tensor``, taken when a module is imported, is checked too), the
pickling step of the object collectives, and the functional collectives
(``torch.distributed._functional_collectives``), which reach the backend from C++.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

from .agreement import agree
from .errors import NcclRuleError
from .objects import HostOnlyPickler, pickling_for
from .signature import describe, describe_functional, tensors_in

# ProcessGroup methods that are collectives (point-to-point send/recv differ by rank by
# design and are left alone); a torch that lacks one simply has nothing to wrap.
COLLECTIVES = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
               "all_gather_single", "_allgather_base", "allgather_coalesced",
               "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "gather",
               "scatter", "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
               "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
               "all_to_all_single", "alltoall_base", "alltoall", "barrier")
FUNCTIONAL = ("all_reduce", "all_gather_tensor", "all_gather_tensor_autograd",
              "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "all_to_all_single",
              "all_to_all_single_autograd")


@dataclasses.dataclass
class GroupState:
    """What the checker keeps per process group."""

    where: str  # "group 'default_pg' (ranks [0, 1])"
    ranks: list[int]  # global ranks, in group order
    exchanges: bool  # ranks compare signatures (gloo, more than one rank)
    device: str | None  # the device type its tensors must be on, if any
    number: int = 0  # collectives issued on it so far by this rank
    coalescing: bool = False  # inside _start/_end_coalescing: nothing may block
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class Checker:
    """Checks every collective against the NCCL rules, then issues it."""

    def __init__(self, originals: dict[str, Callable]):
        # the unchecked flat all-gather the ranks compare with: torch 2.13 names it
        # all_gather_single, torch 2.11 only _allgather_base
        self._all_gather = originals.get("all_gather_single", originals.get("_allgather_base"))
        self._groups: dict[str, GroupState] = {}
        self._devices: dict[str, str] = {}

    def stands_for_device(self, group, device_type: str) -> None:
        """Refuse tensors on ``group`` that are not on ``device_type``."""
        self._devices[group.group_name] = device_type
        self._groups.pop(group.group_name, None)

    def state(self, group) -> GroupState:
        """This group's state, made on first use."""
        state = self._groups.get(group.group_name)
        if state is None:
            state = self._groups[group.group_name] = self._new_state(group)
        return state

    def issue(self, op: str, original: Callable, group, args: tuple, kwargs: dict) -> Any:
        """Check ``op`` on ``group`` with every rule, then issue it."""
        signature = describe(op, args, kwargs)
        tensors = tensors_in((args, tuple(kwargs.values())))
        return self.check_then(group, signature, tensors, lambda: original(group, *args, **kwargs))

    def check_then(self, group, signature: str, tensors, issue: Callable[[], Any]) -> Any:
        """Check the collective ``signature`` on ``group``, then ``issue()`` it."""
        state = self.state(group)
        with state.lock:  # a check and its collective stay adjacent in the group's order
            self._check_devices(state, signature, tensors)
            if state.exchanges and not state.coalescing:
                agree(self._all_gather, group, state.number, signature, state.where,
                      state.ranks)
            state.number += 1
            return issue()

    def _check_devices(self, state: GroupState, signature: str, tensors) -> None:
        if state.device is None:
            return
        for t in tensors:
            if t.device.type != state.device:
                raise NcclRuleError(
                    f"NCCL rule broken on rank {dist.get_rank()}: collective #{state.number} "
                    f"{signature} on {state.where} passes a {t.device.type} tensor to a "
                    f"group that stands for {state.device} devices; NCCL refuses it")

    def _new_state(self, group) -> GroupState:
        ranks = dist.get_process_group_ranks(group)
        name = group.group_desc if group.group_desc != "undefined" else group.group_name
        backend = str(dist.get_backend(group))
        device = self._devices.get(group.group_name) or ("cuda" if backend == "nccl" else None)
        return GroupState(where=f"group {name!r} (ranks {ranks})", ranks=ranks,
                          exchanges=backend == "gloo" and len(ranks) > 1, device=device)


_active: Checker | None = None
_saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) to put back


def install() -> Checker:
    """Wrap torch's collectives with a new checker (once per process); return it."""
    global _active
    if _active is not None:
        return _active
    pg = dist.ProcessGroup
    originals = {op: getattr(pg, op) for op in COLLECTIVES if hasattr(pg, op)}
    _active = Checker(originals)
    for op, original in originals.items():
        _replace(pg, op, _checked_method(op, original))
    for op in ("_start_coalescing", "_end_coalescing"):
        _replace(pg, op, _coalescing_method(getattr(pg, op), op == "_start_coalescing"))
    _replace(c10d, "_object_to_tensor", _checked_object_to_tensor(c10d._object_to_tensor))
    _replace(c10d, "_pickler", HostOnlyPickler)
    for op in FUNCTIONAL:
        if hasattr(funcol, op):
            _replace(funcol, op, _checked_functional(op, getattr(funcol, op)))
    return _active


def uninstall() -> None:
    """Put torch's own collectives back."""
    global _active
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)
    _active = None


def active() -> Checker | None:
    """The installed checker, if any."""
    return _active


def _replace(owner: Any, name: str, value: Any) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _checked_method(op: str, original: Callable) -> Callable:
    def method(group, *args, **kwargs):
        if _active is None:
            return original(group, *args, **kwargs)
        return _active.issue(op, original, group, args, kwargs)
    method.__name__, method.__doc__ = op, original.__doc__
    return method


def _coalescing_method(original: Callable, starts: bool) -> Callable:
    # Collectives between _start_coalescing and _end_coalescing are queued, not run: an
    # exchange among them would wait for the end that never comes, so none is made.
    def method(group, *args, **kwargs):
        if _active is not None:
            _active.state(group).coalescing = starts
        return original(group, *args, **kwargs)
    return method


def _checked_object_to_tensor(original: Callable) -> Callable:
    # (obj, device, group) to torch 2.13; torch 2.15 passes one more argument
    def object_to_tensor(obj, device, group, *more, **named):
        if _active is None:
            return original(obj, device, group, *more, **named)
        op = sys._getframe(1).f_code.co_name  # all_gather_object, broadcast_object_list, ...
        pg = group if group is not None else c10d._get_default_group()
        with pickling_for(op, _active.state(pg).where, dist.get_rank()):
            return original(obj, device, group, *more, **named)
    return object_to_tensor


def _checked_functional(op: str, original: Callable) -> Callable:
    signature = inspect.signature(original)

    def functional(*args, **kwargs):
        if _active is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        values = dict(bound.arguments)
        tensor, group, tag = values.pop("self"), values.pop("group"), values.pop("tag", "")
        pg = c10d._resolve_process_group(funcol._resolve_group_name(group, tag))
        splits = [v for k, v in values.items() if k.endswith("split_sizes")]
        extra = () if splits else tuple(values.values())  # a reduce op, a dim
        text = describe_functional(op, tensor, extra, uneven=any(splits))
        return _active.check_then(pg, text, [tensor], lambda: original(*args, **kwargs))
    functional.__name__, functional.__doc__ = op, original.__doc__
    return functional
