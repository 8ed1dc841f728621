"""Optimizers that need whole matrices (Muon, Shampoo-like) on sharded parameters.

Note [whole-matrix optimizers]
``torch.optim.Muon`` orthogonalizes each 2-D update with a Newton-Schulz iteration over
the *whole* matrix. Stepped on a rank's row shard, as any FSDP hands it (or on a
DTensor, whose matmuls torch's Muon turns into shard-local ones), it orthogonalizes each
shard on its own: training goes on, several percent away from one process's. fullshard
instead steps every such parameter whole, once, on one rank:

* Each parameter is owned by one rank of its shard group, chosen the same way on every
  rank: greedily by the step's cost (rows x columns x the smaller of the two, the
  Newton-Schulz matmuls), largest first, to the least loaded rank.
* Before the step, one all-to-all per shard group sends every rank's rows of each
  parameter, of its reduced gradient and of each optimizer state shaped like it, to the
  owner, which assembles the whole tensors (padding dropped). The optimizer's own
  ``step()`` then runs, unchanged, on each rank's owned whole matrices only (the others
  are taken out of ``param_groups`` for the step).
* After the step, one all-to-all sends each owner's updated rows of the parameter and of
  its states back to the ranks that hold them, which copy them into their shards. States
  the step created are wrapped as DTensors like the parameter, so ``state_dict()``, DCP
  and fullshard.checkpoint see ordinary sharded states, and a checkpoint resumes at any
  world size.

The result is one process's, bit for bit where the arithmetic is the same (each matrix is
stepped by the same code on the same values). Per step, each parameter moves (1 + the
states) x 2 x (N-1)/N of its bytes over its shard group of N ranks, plus its gradient
once: for Muon (one state) 5 x (N-1)/N, against 2 x (N-1)/N for the least any whole-matrix
step can move (the gradient to one rank, the update back); docs/benchmarks.md has the
measured time. Hybrid sharding steps each replica group alike. A parameter sharded on
another dim than 0, tensor-parallel, or offloaded to disk is refused at the first step.

``torch.optim.Muon`` and ``torch.optim.Adafactor`` are registered (Adafactor's factored
states are not shaped like the parameter: its owner sends them to every rank after the
step, which keeps them replicated); ``register_whole_matrix_optimizer(cls)`` declares
another optimizer class whose update needs whole parameters.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .core.param import ShardLayout

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


class _Item(NamedTuple):
    """One sharded parameter of the optimizer, as the step moves it."""
    param: DTensor
    owner_param: object      # its ShardedParam
    pg: dist.ProcessGroup    # its shard group
    owner: int               # the rank (within ``pg``) that steps it whole
    states: tuple[str, ...]  # its optimizer states shaped like it


class WholeStep:
    """What ``before`` swapped into the optimizer, for ``after`` to send back and undo."""

    def __init__(self, items: list[_Item], groups: list[tuple[dict, list]],
                 whole: dict[int, torch.Tensor], kept: dict[int, dict]):
        self.items = items
        self.groups = groups  # (param_group, its original params)
        self.whole = whole    # id(DTensor param) -> the whole tensor stepped here
        self.kept = kept      # id(DTensor param) -> its (sharded) state dict, set aside


def before(opt: torch.optim.Optimizer, owners: list[list]) -> WholeStep:
    """Gather each sharded parameter (value, gradient, states) whole on its owner and
    leave in ``param_groups`` only what this rank steps: its owned whole tensors and the
    optimizer's other (plain) parameters."""
    items = _items(opt, owners)
    kept = {id(item.param): opt.state.get(item.param, {}) for item in items}
    whole = _gather_to_owners(opt, items)
    groups = []
    by_id = {id(item.param): item for item in items}
    for group in opt.param_groups:
        params = group["params"]
        if not any(id(p) in by_id for p in params):
            continue
        groups.append((group, params))
        group["params"] = [whole[id(p)] if id(p) in by_id else p for p in params
                           if id(p) not in by_id or id(p) in whole]
    return WholeStep(items, groups, whole, kept)


def after(opt: torch.optim.Optimizer, step: WholeStep) -> None:
    """Send each owner's updated rows (parameter and states) back, restore ``param_groups``."""
    for group, params in step.groups:
        group["params"] = params
    _scatter_from_owners(opt, step)


def undo(opt: torch.optim.Optimizer, step: WholeStep) -> None:
    """After a step that raised: ``param_groups`` and states as before ``before``."""
    for group, params in step.groups:
        group["params"] = params
    for value in step.whole.values():
        opt.state.pop(value, None)
    for item in step.items:
        opt.state[item.param] = step.kept[id(item.param)]


# -- which rank steps what -------------------------------------------------------------
def _items(opt: torch.optim.Optimizer, owners: list[list]) -> list[_Item]:
    found = []
    for group, group_owners in zip(opt.param_groups, owners):
        for p, sp in zip(group["params"], group_owners):
            if sp is None or p.grad is None:
                continue
            _check_supported(opt, sp)
            states = tuple(k for k, v in opt.state.get(p, {}).items()
                           if isinstance(v, DTensor) and v.shape == p.shape)
            for k in states:
                if opt.state[p][k].dtype != p.dtype:
                    raise RuntimeError(
                        f"fullshard: {type(opt).__name__} state '{k}' of parameter '{sp.fqn}' "
                        f"is {opt.state[p][k].dtype}, the parameter {p.dtype}: a whole-matrix "
                        "step moves them together; keep optimizer states in the parameter's "
                        "dtype.")
            found.append((p, sp, _shard_group(p), states))
    load: dict[int, dict[int, int]] = {}
    items = []
    for p, sp, pg, states in sorted(found, key=lambda f: -_cost(f[0].shape)):
        ranks = load.setdefault(id(pg), {r: 0 for r in range(pg.size())})
        owner = min(ranks, key=lambda r: (ranks[r], r))
        ranks[owner] += _cost(p.shape)
        items.append(_Item(p, sp, pg, owner, states))
    order = {id(p): i for i, (p, *_rest) in enumerate(found)}
    return sorted(items, key=lambda item: order[id(item.param)])


def _cost(shape: torch.Size) -> int:
    rows, cols = shape[0], max(1, shape.numel() // max(1, shape[0]))
    return rows * cols * min(rows, cols)


def _shard_group(p: DTensor) -> dist.ProcessGroup:
    dim = next(i for i, pl in enumerate(p.placements) if isinstance(pl, Shard))
    return p.device_mesh.get_group(dim)


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
def _rows(sp, rank: int) -> tuple[int, int]:
    """(first row, rows) of the parameter on ``rank`` of its shard group."""
    lay = ShardLayout.of(sp.layout.shape, rank, sp.world_size, 0)
    return min(rank * lay.rows_per_rank, lay.shape[0]), lay.valid_rows


def _pieces(opt, item: _Item) -> list[torch.Tensor]:
    """This rank's local rows of the parameter, its gradient and its states."""
    state = opt.state.get(item.param, {})
    return [item.param._local_tensor, item.param.grad._local_tensor,
            *(state[k]._local_tensor for k in item.states)]


def _exchange(pg: dist.ProcessGroup, sends: list[list[torch.Tensor]], receive_numel: list[int],
              dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """All-to-all of ``sends[r]`` (flattened, concatenated) to each rank r; returns what each
    rank sent here, flat."""
    send_numel = [sum(t.numel() for t in pieces) for pieces in sends]
    send = torch.empty(sum(send_numel), dtype=dtype, device=device)
    offset = 0
    for t in (t for pieces in sends for t in pieces):  # one copy in, no intermediate cat
        send[offset:offset + t.numel()].view_as(t).copy_(t)
        offset += t.numel()
    received = torch.empty(sum(receive_numel), dtype=dtype, device=device)
    if pg.size() == 1:
        received.copy_(send)
    else:
        dist.all_to_all_single(received, send, receive_numel, send_numel, group=pg)
    del send  # freed before the caller assembles whole tensors from what arrived
    return list(torch.split(received, receive_numel))


def _by_group(items: list[_Item]) -> dict[int, list[_Item]]:
    groups: dict[int, list[_Item]] = {}
    for item in items:
        groups.setdefault(id(item.pg), []).append(item)
    return groups


def _gather_to_owners(opt, items: list[_Item]) -> dict[int, torch.Tensor]:
    whole: dict[int, torch.Tensor] = {}
    for group_items in _by_group(items).values():
        pg = group_items[0].pg
        me, world = pg.rank(), pg.size()
        ref = group_items[0].param._local_tensor
        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for item in group_items:
            sends[item.owner].extend(_pieces(opt, item))
        receive = [sum((2 + len(item.states)) * _rows(item.owner_param, r)[1]
                       * item.owner_param.layout.row_numel
                       for item in group_items if item.owner == me) for r in range(world)]
        got = _exchange(pg, sends, receive, ref.dtype, _comm_device(pg, ref))
        offsets = [0] * world
        for item in group_items:
            if item.owner != me:
                continue
            parts = []
            for r in range(world):
                rows = _rows(item.owner_param, r)[1] * item.owner_param.layout.row_numel
                parts.append(got[r][offsets[r]:offsets[r] + (2 + len(item.states)) * rows]
                             .view(2 + len(item.states), rows))
                offsets[r] += (2 + len(item.states)) * rows
            full = [torch.cat([part[i] for part in parts]).view(item.param.shape)
                    .to(ref.device) for i in range(2 + len(item.states))]
            value, grad, *states = full
            value.grad = grad
            whole[id(item.param)] = value
            opt.state[value] = {**opt.state.get(item.param, {}),
                                **dict(zip(item.states, states))}
    return whole


def _scatter_from_owners(opt, step: WholeStep) -> None:
    for group_items in _by_group(step.items).values():
        pg = group_items[0].pg
        me, world = pg.rank(), pg.size()
        ref = group_items[0].param._local_tensor
        after = _states_after(opt, group_items, step, pg, me)
        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for item in group_items:
            if item.owner != me:
                continue
            value = step.whole[id(item.param)]
            state = opt.state.get(value, {})
            for r in range(world):
                first, rows = _rows(item.owner_param, r)
                sends[r].append(value.detach().narrow(0, first, rows))
                sends[r].extend(state[k].narrow(0, first, rows)
                                for k in after[id(item.param)][0])
        receive = [sum((1 + len(after[id(item.param)][0])) * _rows(item.owner_param, me)[1]
                       * item.owner_param.layout.row_numel
                       for item in group_items if item.owner == r) for r in range(world)]
        got = _exchange(pg, sends, receive, ref.dtype, _comm_device(pg, ref))
        offsets = [0] * world
        for item in group_items:
            names, scalars = after[id(item.param)]
            k = 1 + len(names)
            rows = _rows(item.owner_param, me)[1] * item.owner_param.layout.row_numel
            mine = got[item.owner][offsets[item.owner]:offsets[item.owner] + k * rows].view(k, -1)
            offsets[item.owner] += k * rows
            _write_back(opt, item, mine, names, scalars, step)


def _states_after(opt, group_items, step: WholeStep, pg, me: int) -> dict[int, tuple]:
    """Each parameter's states after the step, as its owner has them: (names of those
    shaped like it, the others by value, e.g. a step count). Every rank knows them
    already when each parameter had its states before the step (the step updates them in
    place) and has no other state (a counter would change on the owner alone); otherwise
    (a first step creates them) the owners tell everyone."""
    def described(item: _Item) -> tuple:
        state = opt.state.get(step.whole[id(item.param)], {})
        names = tuple(k for k, v in state.items()
                      if isinstance(v, torch.Tensor) and v.shape == item.param.shape)
        return names, {k: v for k, v in state.items() if k not in names}

    known = all(item.states and set(step.kept[id(item.param)]) == set(item.states)
                for item in group_items)
    if known:  # updated in place, no other state: the same everywhere
        return {id(item.param): described(item) if item.owner == me else
                (item.states, {k: v for k, v in step.kept[id(item.param)].items()
                               if k not in item.states})
                for item in group_items}
    mine = [described(item) if item.owner == me else None for item in group_items]
    everyone: list = [None] * pg.size()
    dist.all_gather_object(everyone, mine, group=pg)
    return {id(item.param): everyone[item.owner][i] for i, item in enumerate(group_items)}


def _write_back(opt, item: _Item, rows: torch.Tensor, names: tuple, scalars: dict,
                step: WholeStep) -> None:
    p = item.param
    local = p._local_tensor
    with torch.no_grad():
        local.copy_(rows[0].view_as(local))
    if item.owner == item.pg.rank():
        value = step.whole[id(p)]
        opt.state.pop(value, None)
        value.grad = None
    state = step.kept[id(p)]
    state.update(scalars)
    for i, k in enumerate(names, start=1):
        current = state.get(k)
        if isinstance(current, DTensor):
            current._local_tensor.copy_(rows[i].view_as(local))
        else:
            state[k] = DTensor(rows[i].view_as(local).clone(), p._spec, requires_grad=False)
    opt.state[p] = state


def _comm_device(pg: dist.ProcessGroup, ref: torch.Tensor) -> torch.device:
    """Where the all-to-all runs: the mesh's device (an offloaded shard is copied there)."""
    backend = str(dist.get_backend(pg))
    if "nccl" in backend and ref.device.type == "cpu":
        return torch.device("cuda", torch.cuda.current_device())
    return ref.device
