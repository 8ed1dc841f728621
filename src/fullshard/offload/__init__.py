"""Offload beyond host memory: optimizer states on disk (Note [optimizer states on disk])."""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from ..core.state import groups_in_order
from ..policies import DiskOffloadPolicy
from .optimizer_states import DiskStates

# optimizer -> {policy: DiskStates}; weak: this module must not keep an optimizer alive
# (when it goes, its DiskStates go, and with them their files).
_STATES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict]" = weakref.WeakKeyDictionary()


def step_on_disk(opt: torch.optim.Optimizer, params: list[tuple[DTensor, object]],
                 run_step: Callable[[], None]) -> None:
    """Step ``params`` (the optimizer's disk-offloaded parameters, in ``param_groups``
    order, with their ShardedParams) chunk by chunk; ``run_step`` runs ``opt``'s own step
    over whatever ``param_groups`` hold at the time."""
    for states in disk_states(opt, params):
        states.step(opt, run_step)


def disk_states(opt: torch.optim.Optimizer, params: list[tuple[DTensor, object]]
                ) -> list[DiskStates]:
    """The stores of ``params`` (every parameter of ``opt`` whose states are on disk, in
    ``param_groups`` order, with its ShardedParam), one per policy: made at their first
    step, made again (from the values) when the parameters or their units' order change,
    dropped for policies no parameter has any more. Each lays its parameters out unit by
    unit in the order forward gathers the units (Note [the disk step on the host thread])."""
    groups, order = groups_in_order()
    by_policy: dict[DiskOffloadPolicy, list[tuple[int, int, DTensor]]] = {}
    for position, (p, owner) in enumerate(params):
        group = groups.get(id(owner))
        unit = order[group] if group is not None else len(order)
        by_policy.setdefault(owner.offload, []).append((unit, position, p))
    current = _STATES.get(opt)
    if current is None:
        current = _STATES[opt] = {}
        opt.register_state_dict_post_hook(_fill_state_dict)
    for policy in [k for k in current if k not in by_policy]:  # parameters gone from opt
        _drop(opt, current, policy)
    found = []
    for policy, entries in by_policy.items():
        entries.sort(key=lambda e: e[:2])
        # each unit's place among these parameters' units: other roots made or dropped
        # (an evaluation copy of the model) leave it, and so the files, as they are
        rank = {u: r for r, u in enumerate(sorted({e[0] for e in entries}))}
        units, group = [rank[e[0]] for e in entries], [e[2] for e in entries]
        states = current.get(policy)
        if states is not None and states.key != tuple(zip(map(id, group), units)):
            _drop(opt, current, policy)  # param_groups changed: start over from the values
            states = None
        if states is None:
            states = current[policy] = DiskStates(
                group, units, policy, f"DiskOffloadPolicy(path={policy.path!r})")
        found.append(states)
    return found


def _drop(opt, current: dict, policy) -> None:
    states = current.pop(policy)
    states.materialize(opt)
    states.close()


def _fill_state_dict(opt: torch.optim.Optimizer, state_dict: dict):
    for states in _STATES.get(opt, {}).values():
        states.fill_state_dict(opt, state_dict)
    return state_dict


def disk_states_of(opt: torch.optim.Optimizer) -> list[DiskStates]:
    """The optimizer's disk-state stores (tests and benchmarks read their counters)."""
    return list(_STATES.get(opt, {}).values())
