"""Offload beyond host memory: optimizer states on disk (Note [optimizer states on disk])."""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from ..policies import DiskOffloadPolicy
from .optimizer_states import DiskStates

# optimizer -> {policy: DiskStates}; weak: this module must not keep an optimizer alive
# (when it goes, its DiskStates go, and with them their files).
_STATES: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict]" = weakref.WeakKeyDictionary()


def step_on_disk(opt: torch.optim.Optimizer,
                 params: list[tuple[DTensor, DiskOffloadPolicy]],
                 run_step: Callable[[], None]) -> None:
    """Step ``params`` (the optimizer's disk-offloaded parameters, in ``param_groups``
    order, with their units' policies) chunk by chunk; ``run_step`` runs ``opt``'s own
    step over whatever ``param_groups`` hold at the time."""
    by_policy: dict[DiskOffloadPolicy, list[DTensor]] = {}
    for p, policy in params:
        by_policy.setdefault(policy, []).append(p)
    current = _STATES.get(opt)
    if current is None:
        current = _STATES[opt] = {}
        opt.register_state_dict_post_hook(_fill_state_dict)
    for policy in [k for k in current if k not in by_policy]:  # parameters gone from opt
        _drop(opt, current, policy)
    for policy, group in by_policy.items():
        states = current.get(policy)
        if states is not None and states.key != tuple(id(p) for p in group):
            _drop(opt, current, policy)  # param_groups changed: start over from the values
            states = None
        if states is None:
            states = current[policy] = DiskStates(
                group, policy, f"DiskOffloadPolicy(path={policy.path!r})")
        states.step(opt, run_step)


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
