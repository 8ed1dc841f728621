"""What a whole-matrix optimizer keeps between steps on the ranks that own its
parameters, and how ``state_dict()`` and ``load_state_dict()`` see it (Note
[whole-matrix optimizers], "Between steps")."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..core.guard.arrival import every_rank_arrives
from .exchange import (Item, all_to_all, by_group, comm_device, device_values, host_values,
                       numel, piece)


class Kept:
    """One optimizer's whole-matrix state between steps.

    ``items``: every sharded parameter the optimizer holds and its owner, the same on
    every rank and stable from step to step (the owners keep state for them).
    ``whole``: the owner's whole copy of each parameter it owns, as of the last step.
    ``states``: the owner's state dict of each parameter it owns (whole tensors).
    ``held``: the parameters whose states live on their owners (the same set on every
    rank; their ``opt.state[p]`` is an empty dict meanwhile).
    ``rows``: this rank's rows of each parameter as the last step wrote them, to see
    whether anything changed them since (then the owner's whole copy is stale).
    """

    def __init__(self, items: list[Item], signature: tuple):
        self.items = items
        self.signature = signature
        self.whole: dict[int, torch.Tensor] = {}
        self.states: dict[int, dict] = {}
        self.held: set[int] = set()
        self.rows: dict[int, torch.Tensor] = {}


# Per optimizer: its Kept, and whether its state-dict hooks are installed. Keyed weakly
# (this package must not keep a user's optimizer alive); process-global because the
# optimizer's own step hooks (optim.py) find it from the optimizer alone.
_KEPT: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Kept]" = weakref.WeakKeyDictionary()
_HOOKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def kept_for(opt: torch.optim.Optimizer, items: list[Item], signature: tuple) -> Kept:
    """The optimizer's Kept for this assignment. A new assignment (``param_groups``
    changed) first hands the states held under the old one back to ``opt.state``."""
    if opt not in _HOOKED:
        opt.register_state_dict_pre_hook(_release_for_state_dict)
        opt.register_load_state_dict_pre_hook(_discard)
        _HOOKED.add(opt)
    kept = _KEPT.get(opt)
    if kept is None or kept.signature != signature:
        if kept is not None:
            release(opt)
        kept = _KEPT[opt] = Kept(items, signature)
    return kept


def kept_if_unchanged(opt: torch.optim.Optimizer, signature: tuple) -> Kept | None:
    """The optimizer's Kept if its assignment still holds (the same parameters, shard
    groups and shapes: ``signature``), so that a step need not place them again."""
    kept = _KEPT.get(opt)
    return kept if kept is not None and kept.signature == signature else None


def _release_for_state_dict(opt: torch.optim.Optimizer) -> None:
    """``state_dict()``'s pre-hook: handing the states back is a collective, so a call on
    some ranks only (``if rank == 0: opt.state_dict()``) is refused after the arrival
    timeout instead of waiting forever (Note [every rank arrives])."""
    kept = _KEPT.get(opt)
    if kept is not None and kept.held and dist.is_initialized():
        every_rank_arrives(f"{type(opt).__name__}.state_dict() (its states are held by "
                           "the ranks that own its matrices)")
    release(opt)


def release(opt: torch.optim.Optimizer) -> None:
    """Put the states the owners hold back into ``opt.state`` in torch's layout: each
    tensor shaped like its parameter as a DTensor sharded like it, the rest (step counts,
    factored moments) by value on every rank. ``state_dict()`` runs this first (as a
    pre-hook), so it is a collective over each shard group, as DCP's state dicts are.
    The next step gathers the states to their owners again."""
    kept = _KEPT.get(opt)
    if kept is None or not kept.held:
        return
    held = [item for item in kept.items if id(item.param) in kept.held]
    for group_items in by_group(held):
        _release_group(opt, kept, group_items)
    kept.held.clear()
    kept.states.clear()


def _release_group(opt, kept: Kept, group_items: list[Item]) -> None:
    pg = group_items[0].pg
    me, world = pg.rank(), pg.size()
    ref = group_items[0].param._local_tensor
    described = _described_by_owners(opt, kept, group_items, ref.device)
    sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for item, (names, _) in zip(group_items, described):
        if item.owner != me:
            continue
        state = kept.states.get(id(item.param), {})
        for r in range(world):
            sends[r].extend(piece(item, state[k], r) for k in names)
    receive = [sum(len(names) * numel(item, me) for item, (names, _) in zip(group_items, described)
                   if item.owner == r) for r in range(world)]
    got = all_to_all(pg, sends, receive, ref.dtype, comm_device(pg, ref))
    offsets = [0] * world
    for item, (names, scalars) in zip(group_items, described):
        p, n = item.param, numel(item, me)
        own = kept.states.get(id(p), {}) if item.owner == me else {}
        state = {k: own.get(k, v) for k, v in scalars.items()}  # the owner keeps its objects
        for k in names:
            mine = got[item.owner][offsets[item.owner]:offsets[item.owner] + n]
            offsets[item.owner] += n
            state[k] = DTensor(mine.view_as(p._local_tensor).to(ref.device), p._spec,
                               requires_grad=False)
        opt.state[p] = state


def _described_by_owners(opt, kept: Kept, group_items: list[Item], device: torch.device
                         ) -> list[tuple]:
    """Each item's ``describe`` as its owner sees it, on every rank of the group. Values
    that are tensors on a device (Adafactor's factored moments) travel through the host
    and land on ``device``; the owner keeps its own."""
    pg = group_items[0].pg
    me, world = pg.rank(), pg.size()
    local = [describe(opt, item, kept.states.get(id(item.param), {}), sharded=False)
             if item.owner == me else None for item in group_items]
    if world == 1:
        return local
    mine = [None if d is None else (d[0], host_values(d[1])) for d in local]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=pg)
    described = []
    for i, item in enumerate(group_items):
        names, scalars = local[i] if item.owner == me else everyone[item.owner][i]
        described.append((names, scalars if item.owner == me else device_values(scalars, device)))
    return described


def describe(opt, item: Item, state: dict, sharded: bool) -> tuple:
    """(names of the states that travel as rows: shaped like the parameter, as DTensors
    sharded like it if ``sharded``, else whole; the others, by value). A whole tensor in
    ``opt.state[p]`` (a full state dict loaded on every rank) reaches the owner as is."""
    names = tuple(k for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.shape == item.param.shape
                  and isinstance(v, DTensor) == sharded)
    for k in names:
        if state[k].dtype != item.param.dtype:
            raise RuntimeError(
                f"fullshard: {type(opt).__name__} state '{k}' of parameter '{item.sp.fqn}' is "
                f"{state[k].dtype}, the parameter {item.param.dtype}: a whole-matrix step "
                "moves them together; keep optimizer states in the parameter's dtype.")
    return names, {k: v for k, v in state.items() if k not in names}


def _discard(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """``load_state_dict`` replaces every state: what the owners hold goes (the loaded
    states, in ``opt.state``, are gathered to the owners at the next step)."""
    kept = _KEPT.get(opt)
    if kept is not None:
        kept.held.clear()
        kept.states.clear()


def forget(opt: torch.optim.Optimizer) -> None:
    """Drop the owners' whole copies (a step that raised may have changed them half-way);
    the next step gathers the parameters again. The states stay as the step left them,
    as they would in one process."""
    kept = _KEPT.get(opt)
    if kept is not None:
        kept.whole.clear()
        kept.rows.clear()
