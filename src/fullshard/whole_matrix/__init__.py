"""Optimizers that need whole matrices (Muon, Shampoo-like) on sharded parameters.

Note [whole-matrix optimizers]
``torch.optim.Muon`` orthogonalizes each 2-D update with a Newton-Schulz iteration over
the *whole* matrix. Stepped on a rank's row shard, as any FSDP hands it (or on a
DTensor, whose matmuls torch's Muon turns into shard-local ones), it orthogonalizes each
shard on its own: training goes on, several percent away from one process's. fullshard
instead steps every such parameter whole, once, on one rank, and moves per step only
what that needs:

* Each parameter is owned by one rank of its shard group, chosen the same way on every
  rank: greedily by the step's cost (the Newton-Schulz matmuls, 2 m^2 n + m^3 for an
  m x n matrix, m <= n), largest first, to the least loaded rank. Every sharded
  parameter the optimizer holds is placed, with a gradient this step or not, so owners
  stay put from step to step (they keep state, below) until ``param_groups`` change.
* Before the step, one all-to-all per shard group sends every rank's rows of each
  parameter's reduced gradient to its owner, which assembles the whole gradient (padding
  dropped). The optimizer's own ``step()`` then runs, unchanged, on each rank's owned
  whole matrices only (the others are taken out of ``param_groups`` for the step).
* After the step, one all-to-all sends each owner's updated rows of the parameter back
  to the ranks that hold them, which copy them into their shards.

That is 2 x (N-1)/N of the parameters' bytes per step over a shard group of N ranks, the
least any whole-matrix step can move: the gradient to one rank, the update back. It
holds because the owner keeps, between steps, what the step also needs:

* Its optimizer states, whole (Muon's momentum). ``opt.state[p]`` holds an empty dict
  meanwhile. ``state_dict()`` first hands the states back in torch's layout (a pre-hook:
  each state shaped like the parameter as a DTensor sharded like it, the others, such
  as Adafactor's factored moments and step count, by value on every rank), so
  ``state_dict()``, DCP and fullshard.checkpoint see ordinary sharded states and a
  checkpoint resumes at any world size. ``state_dict()`` is then a collective over each
  shard group, as DCP's state dicts are. States found in ``opt.state[p]`` at a step
  (handed back, loaded, or set by hand) are the current ones and travel to the owner
  with the gradient, once; ``load_state_dict`` drops what the owners held (a pre-hook),
  and a parameter whose entry was removed (``opt.state.clear()``) starts afresh, as in
  one process. The ranks must agree on which parameters have entries: a step after
  states were loaded or changed on some ranks only is refused on every rank (E225).
* A whole copy of the parameter, used while every rank's rows still hold, bit for bit,
  what the last step wrote there. Each rank keeps those rows (the return's buffer, 1/N
  of the parameters) and compares; one all-reduce of a few bytes per parameter tells
  every rank which parameters changed (a load, an edit under ``no_grad``, another
  optimizer), and their rows travel with the gradient. A version counter cannot tell:
  a unit's parameters view one flat shard and share its counter, so an AdamW step on
  the unit's biases bumps every matrix's, and writes through ``.data`` bump none.

Memory per rank: the owned whole parameters and states (about 1/N of the matrices each
when balanced) and its rows as last written (1/N), where the sharded states took 1/N;
during the step, the owned whole gradients and the pieces in flight.

The result is one process's, bit for bit where the arithmetic is the same (each matrix is
stepped by the same code on the same values); docs/benchmarks.md has the measured time
and bytes. Hybrid sharding steps each replica group alike. A parameter sharded on
another dim than 0, tensor-parallel, or offloaded to disk is refused at the first step.
A step that raised leaves the states as the stock step left them (as in one process)
and the shards as they were; the owners' whole copies are dropped.

``torch.optim.Muon`` and ``torch.optim.Adafactor`` are registered;
``register_whole_matrix_optimizer(cls)`` declares another optimizer class whose update
needs whole parameters.
"""

from __future__ import annotations

import torch

from .exchange import (Item, agree, all_to_all, by_group, comm_device, numel, rows, same_bits,
                       shard_group)
from .kept import Kept, describe, forget, kept_for
from .recipe import owners_by_cost, step_cost

# Muon orthogonalizes each matrix; Adafactor factors each matrix's second moment over its
# whole rows and columns (on DTensor shards torch's fails outright).
WHOLE_MATRIX_OPTIMIZERS: set[type] = {getattr(torch.optim, name) for name in ("Muon", "Adafactor")
                                      if hasattr(torch.optim, name)}


def register_whole_matrix_optimizer(cls: type) -> None:
    """Declare that optimizer class ``cls`` needs whole parameters for its update: fullshard
    then steps its sharded parameters whole, each on one rank (Note [whole-matrix
    optimizers])."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"register_whole_matrix_optimizer: expected a torch.optim.Optimizer "
                        f"subclass, got {cls!r}")
    WHOLE_MATRIX_OPTIMIZERS.add(cls)


def needs_whole_matrices(opt: torch.optim.Optimizer) -> bool:
    return any(isinstance(opt, cls) for cls in WHOLE_MATRIX_OPTIMIZERS)


class WholeStep:
    """What ``before`` swapped into the optimizer, for ``after`` to send back and undo."""

    def __init__(self, kept: Kept, items: list[Item]):
        self.kept = kept
        self.items = items    # the parameters stepped (those with a gradient), in order
        self.groups: list[tuple[dict, list]] = []  # (param_group, its original params)
        self.whole: dict[int, torch.Tensor] = {}   # id(DTensor param) -> whole tensor here
        self.taken: dict[int, dict] = {}  # id(param) -> the state the owner held, in use


def before(opt: torch.optim.Optimizer, owners: list[list]) -> WholeStep:
    """Gather each sharded parameter's gradient (and whatever its owner lacks) whole on
    its owner and leave in ``param_groups`` only what this rank steps: its owned whole
    tensors and the optimizer's other (plain) parameters."""
    kept = _kept(opt, owners)
    step = WholeStep(kept, [item for item in kept.items if item.param.grad is not None])
    for item in step.items:
        _check_supported(opt, item.sp)
    for group_items in by_group(step.items):
        _gather_group(opt, step, group_items)
    sharded = {id(item.param) for item in kept.items}
    for group in opt.param_groups:
        params = group["params"]
        if not any(id(p) in sharded for p in params):
            continue
        step.groups.append((group, params))
        group["params"] = [step.whole.get(id(p), p) for p in params
                           if id(p) not in sharded or id(p) in step.whole]
    return step


def after(opt: torch.optim.Optimizer, step: WholeStep) -> None:
    """Keep each owned parameter's whole copy and states on its owner, send the updated
    rows back, restore ``param_groups``."""
    for group, params in step.groups:
        group["params"] = params
    kept = step.kept
    for item in step.items:
        key = id(item.param)
        value = step.whole.get(key)
        if value is not None:
            kept.states[key] = opt.state.pop(value, {})
            kept.whole[key] = value
            value.grad = None
        opt.state[item.param] = {}  # its states are on the owner (Note: "Between steps")
        kept.held.add(key)
    written: dict[int, torch.Tensor] = {}
    for group_items in by_group(step.items):
        _return_group(step, group_items, written)
    kept.rows = written  # a parameter stepped now and then is gathered again when stepped


def undo(opt: torch.optim.Optimizer, step: WholeStep) -> None:
    """After a step that raised: ``param_groups`` as before ``before``, the shards as they
    were, the owners' states as the step left them; the whole copies are dropped."""
    for group, params in step.groups:
        group["params"] = params
    for key, value in step.whole.items():
        opt.state.pop(value, None)
        value.grad = None
    step.kept.states.update(step.taken)
    forget(opt)


# -- which rank steps what -------------------------------------------------------------
def _kept(opt: torch.optim.Optimizer, owners: list[list]) -> Kept:
    found = [(p, sp, shard_group(p)) for group, group_owners in zip(opt.param_groups, owners)
             for p, sp in zip(group["params"], group_owners) if sp is not None]
    signature = tuple((id(p), id(pg)) for p, _, pg in found)
    placed = {}
    for pg_id in dict.fromkeys(id(pg) for _, _, pg in found):  # each shard group alone
        members = [(p, sp, pg) for p, sp, pg in found if id(pg) == pg_id]
        owners = owners_by_cost([step_cost(p.shape[0], p.numel()) for p, _, _ in members],
                                members[0][2].size())
        for (p, sp, pg), owner in zip(members, owners):
            placed[id(p)] = Item(p, sp, pg, owner)
    return kept_for(opt, [placed[id(p)] for p, _, _ in found], signature)


def _check_supported(opt: torch.optim.Optimizer, sp) -> None:
    why = ("it is sharded on dim {} (shard_placement_fn)".format(sp.layout.dim)
           if sp.layout.dim != 0 else
           "it is tensor-parallel" if sp.tp_spec is not None else
           "its unit keeps optimizer states on disk"
           if type(sp.offload).__name__ == "DiskOffloadPolicy" else None)
    if why is not None:
        raise RuntimeError(
            f"fullshard: {type(opt).__name__} needs whole matrices "
            "(Note [whole-matrix optimizers]) "
            f"but parameter '{sp.fqn}' cannot be stepped whole: {why}. Shard it on dim 0 "
            "without tensor parallelism and with optimizer states in memory, or give it to "
            "an elementwise optimizer.")


# -- the two all-to-alls -----------------------------------------------------------------
def _what_travels(opt, kept: Kept, item: Item, me: int) -> tuple[list[int], tuple]:
    """This rank's view of one parameter: [its rows changed since the last step wrote
    them (or its owner has no whole copy), how ``opt.state`` holds it (0: no entry, 1: an
    empty one, 2: states), how many of those are shaped like it], and their names."""
    p = item.param
    written = kept.rows.get(id(p))
    changed = (written is None or not same_bits(p._local_tensor, written)
               or (item.owner == me and id(p) not in kept.whole))
    entry = opt.state[p] if p in opt.state else None
    names = describe(opt, item, entry, sharded=True)[0] if entry else ()
    return [int(changed), 0 if entry is None else 2 if entry else 1, len(names)], names


def _gather_group(opt, step: WholeStep, group_items: list[Item]) -> None:
    pg = group_items[0].pg
    me, world = pg.rank(), pg.size()
    ref = group_items[0].param._local_tensor
    device = comm_device(pg, ref)
    views = [_what_travels(opt, step.kept, item, me) for item in group_items]
    plan = []
    sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for item, (_, names), (high, low) in zip(group_items, views,
                                             agree(pg, [v[0] for v in views], device)):
        if high[1:] != low[1:]:
            raise RuntimeError(
                f"fullshard: {type(opt).__name__} holds optimizer state for parameter "
                f"'{item.sp.fqn}' in another form on some ranks of its shard group than on "
                "others (states loaded or changed in optimizer.state on some ranks only): "
                "its owner, which steps it whole, would combine them. Load or change "
                "optimizer states on every rank (optimizer.load_state_dict, "
                "set_optimizer_state_dict).")
        changed, present = bool(high[0]), high[1]
        p = item.param
        sends[item.owner].append(p.grad._local_tensor)
        if changed:
            sends[item.owner].append(p._local_tensor)
        sends[item.owner].extend(opt.state[p][k]._local_tensor for k in names)
        plan.append((item, changed, present, names))
    receive = [sum((1 + changed + len(names)) * numel(item, r)
                   for item, changed, _, names in plan if item.owner == me)
               for r in range(world)]
    got = all_to_all(pg, sends, receive, ref.dtype, device)
    offsets = [0] * world
    for item, changed, present, names in plan:
        if item.owner != me:
            continue
        parts = []
        for r in range(world):
            k, n = 1 + changed + len(names), numel(item, r)
            parts.append(got[r][offsets[r]:offsets[r] + k * n].view(k, n))
            offsets[r] += k * n
        whole = [torch.cat([part[i] for part in parts]).view(item.param.shape).to(ref.device)
                 for i in range(1 + changed + len(names))]
        _assemble(opt, step, item, whole, changed, present, names)


def _assemble(opt, step: WholeStep, item: Item, whole: list[torch.Tensor], changed: bool,
              present: int, names: tuple) -> None:
    """The owner's whole parameter, gradient and states for the step."""
    p, key, kept = item.param, id(item.param), step.kept
    grad, *rest = whole
    value = rest.pop(0) if changed else kept.whole[key]
    value.grad = grad
    held = kept.states.pop(key, {})
    if present == 1:    # an empty entry: the states are the ones held here
        state = step.taken[key] = held
    elif present == 2:  # states in opt.state (loaded, handed back or set): these count
        state = {k: v for k, v in opt.state[p].items() if k not in names}
        state.update(zip(names, rest))
    else:               # no entry: the states were removed, as for a fresh optimizer
        state = {}
    step.whole[key] = value
    opt.state[value] = state


def _return_group(step: WholeStep, group_items: list[Item],
                  written: dict[int, torch.Tensor]) -> None:
    pg = group_items[0].pg
    me, world = pg.rank(), pg.size()
    ref = group_items[0].param._local_tensor
    sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for item in group_items:
        if item.owner == me:
            value = step.whole[id(item.param)]
            for r in range(world):
                first, count = rows(item, r)
                sends[r].append(value.detach().narrow(0, first, count))
    receive = [sum(numel(item, me) for item in group_items if item.owner == r)
               for r in range(world)]
    got = all_to_all(pg, sends, receive, ref.dtype, comm_device(pg, ref))
    if got and got[0].device != ref.device:  # kept beside the shards, to compare there
        got = [g.to(ref.device) for g in got]
    offsets = [0] * world
    for item in group_items:
        local, n = item.param._local_tensor, numel(item, me)
        mine = got[item.owner][offsets[item.owner]:offsets[item.owner] + n].view_as(local)
        offsets[item.owner] += n
        with torch.no_grad():
            local.copy_(mine)
        written[id(item.param)] = mine
