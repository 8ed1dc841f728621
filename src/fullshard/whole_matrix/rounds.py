"""The rounds of a whole-matrix step (Note [whole-matrix optimizers], "In rounds"): what
each parameter's owner needs, agreed on every rank, split so that each round brings every
rank one parameter to step whole and sends its updated rows back while the next one
steps."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .exchange import (InFlight, Item, agree, comm_device, differs, join, numel, piece,
                       start_all_to_all)
from .kept import Kept, describe
from .recipe import step_cost


class Entry(NamedTuple):
    """One parameter of the step and what travels with its gradient to the owner."""
    item: Item
    changed: bool    # its rows changed since the last step wrote them: they travel too
    present: int     # how opt.state holds it: 0 no entry, 1 an empty one, 2 states
    names: tuple     # the states, shaped like it, that travel as rows


class Round:
    """Some parameters of one shard group, at most ``per_round`` owned by each rank: one
    all-to-all brings their gradients (and what else the owners lack) to the owners,
    another sends the updated rows back."""

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        self.pg = entries[0].item.pg
        self.me = self.pg.rank()
        self.ref = entries[0].item.param._local_tensor
        self.gather: InFlight | None = None
        self.back: InFlight | None = None

    def mine(self) -> list[Entry]:
        return [e for e in self.entries if e.item.owner == self.me]

    def start_gather(self, opt) -> None:
        """Send this rank's rows of each parameter's gradient (and, where they travel, of
        the parameter and its states) to the parameter's owner."""
        world = self.pg.size()
        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for item, changed, _, names in self.entries:
            p = item.param
            sends[item.owner].append(p.grad._local_tensor)
            if changed:
                sends[item.owner].append(p._local_tensor)
            sends[item.owner].extend(opt.state[p][k]._local_tensor for k in names)
        receive = [sum((1 + e.changed + len(e.names)) * numel(e.item, r) for e in self.mine())
                   for r in range(world)]
        self.gather = start_all_to_all(self.pg, sends, receive, self.ref.dtype,
                                       comm_device(self.pg, self.ref))

    def assemble(self, opt, step) -> list[torch.Tensor]:
        """Wait for the gather; put together, on each owner, the whole parameter (with its
        gradient) and states of what it owns in this round. Returns those parameters."""
        got = self.gather.wait()
        self.gather = None
        offsets = [0] * self.pg.size()
        owned = []
        for entry in self.mine():
            k = 1 + entry.changed + len(entry.names)
            parts = []
            for r in range(self.pg.size()):
                n = numel(entry.item, r)
                parts.append(got[r][offsets[r]:offsets[r] + k * n].view(k, n))
                offsets[r] += k * n
            whole = [join(entry.item, [part[i] for part in parts]).to(self.ref.device)
                     for i in range(k)]
            owned.append(_assemble(opt, step, entry, whole))
        return owned

    def start_return(self, step) -> None:
        """Send each owned parameter's updated rows to the ranks that hold them."""
        world = self.pg.size()
        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for entry in self.mine():
            value = step.whole[id(entry.item.param)]
            for r in range(world):
                sends[r].append(piece(entry.item, value.detach(), r))
        receive = [sum(numel(e.item, self.me) for e in self.entries if e.item.owner == r)
                   for r in range(world)]
        self.back = start_all_to_all(self.pg, sends, receive, self.ref.dtype,
                                     comm_device(self.pg, self.ref))

    def settle_return(self) -> None:
        """Wait for the return (by now long done), which frees its send buffer; the rows
        go into the shards at the end of the step, so that a step that raises leaves
        them as they were."""
        self.back.wait()

    def finish_return(self, written: dict[int, torch.Tensor]) -> None:
        """Wait for the return; copy this rank's updated rows into its shards, and keep
        them as written (``written``)."""
        got = self.back.wait()
        self.back = None
        if got and got[0].device != self.ref.device:  # kept beside the shards, to compare
            got = [g.to(self.ref.device) for g in got]
        offsets = [0] * self.pg.size()
        for item in (e.item for e in self.entries):
            local, n = item.param._local_tensor, numel(item, self.me)
            mine = got[item.owner][offsets[item.owner]:offsets[item.owner] + n].view_as(local)
            offsets[item.owner] += n
            with torch.no_grad():
                local.copy_(mine)
            written[id(item.param)] = mine


def plan_rounds(opt, kept: Kept, group_items: list[Item], per_round: int | None) -> list[Round]:
    """Agree, over the shard group, on what travels with each parameter's gradient, and
    split the parameters into rounds of at most ``per_round`` per owner (None: one round).
    Each owner's parameters go in the order of their cost, largest first, so that a
    round's steps take about as long on every rank."""
    pg = group_items[0].pg
    me = pg.rank()
    device = comm_device(pg, group_items[0].param._local_tensor)
    views = [_what_travels(opt, kept, item, me) for item in group_items]
    agreed = agree(pg, [v[0] for v in views], device, [v[2] for v in views])
    entries = []
    for item, (_, names, _), (high, low) in zip(group_items, views, agreed):
        if high[1:] != low[1:]:
            raise RuntimeError(
                f"fullshard: {type(opt).__name__} holds optimizer state for parameter "
                f"'{item.sp.fqn}' in another form on some ranks of its shard group than on "
                "others (states loaded or changed in optimizer.state on some ranks only): "
                "its owner, which steps it whole, would combine them. Load or change "
                "optimizer states on every rank (optimizer.load_state_dict, "
                "set_optimizer_state_dict).")
        entries.append(Entry(item, bool(high[0]), high[1], names))
    if per_round is None:
        return [Round(entries)]
    owned = [sorted((e for e in entries if e.item.owner == r),
                    key=lambda e: -step_cost(e.item.param.shape[0], e.item.param.numel()))
             for r in range(pg.size())]
    count = max(len(o) for o in owned)
    return [Round([e for o in owned for e in o[k * per_round:(k + 1) * per_round]])
            for k in range(-(-count // per_round))]


def _what_travels(opt, kept: Kept, item: Item, me: int) -> tuple[list[int], tuple, object]:
    """This rank's view of one parameter: [its rows changed since the last step wrote
    them (or its owner has no whole copy), how ``opt.state`` holds it (0: no entry, 1: an
    empty one, 2: states), how many of those are shaped like it], their names, and, where
    only the bits can tell whether the rows changed, ``differs`` of them (unread: ``agree``
    reads every parameter's at once)."""
    p = item.param
    local, written = p._local_tensor, kept.rows.get(id(p))
    changed = (written is None or local.shape != written.shape or local.dtype != written.dtype
               or (item.owner == me and id(p) not in kept.whole))
    check = None if changed else differs(local, written)
    entry = opt.state[p] if p in opt.state else None
    names = describe(opt, item, entry, sharded=True)[0] if entry else ()
    return [int(changed), 0 if entry is None else 2 if entry else 1, len(names)], names, check


def _assemble(opt, step, entry: Entry, whole: list[torch.Tensor]) -> torch.Tensor:
    """The owner's whole parameter, gradient and states for the step."""
    p, key, kept = entry.item.param, id(entry.item.param), step.kept
    grad, *rest = whole
    value = rest.pop(0) if entry.changed else kept.whole[key]
    value.grad = grad
    held = kept.states.pop(key, {})
    if entry.present == 1:    # an empty entry: the states are the ones held here
        state = step.taken[key] = held
    elif entry.present == 2:  # states in opt.state (loaded, handed back or set): these count
        state = {k: v for k, v in opt.state[p].items() if k not in entry.names}
        state.update(zip(entry.names, rest))
    else:                     # no entry: the states were removed, as for a fresh optimizer
        state = {}
    step.whole[key] = value
    opt.state[value] = state
    return value
