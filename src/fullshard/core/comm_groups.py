"""How a group communicates beyond its shard group: torch's communication setters.

``CommOptions`` is what ``set_separate_reduce_scatter_group``,
``set_reduce_scatter_max_input_buffers``, ``set_allocate_memory_from_process_group_for_comm``
and ``set_symm_mem_for_comm`` leave on a ParamGroup (``group.comm_options``); the
reduction, the gather and the root read it. ``separate_reduce_groups`` makes the process
groups of their own.

Note [a reduce-scatter group of its own]
On NCCL one communicator runs one collective at a time, so a backward's reduce-scatter
and the next unit's all-gather, issued on streams of their own, still queue behind each
other on the shard group's communicator. ``set_separate_reduce_scatter_group`` gives the
gradient reduce-scatters a process group of their own over the same ranks, as torch's
FSDP2 does: one ``dist.new_group`` per distinct rank set within one call (every unit of a
usual model shards over the same ranks: one group), and a group that already has one
keeps it. Only the ranks of the set take part in making it
(``use_local_synchronization=True``): under hybrid sharding each rank makes its own shard
group's only. Making a group is a collective over those ranks, so every rank calls the
setter in the same order, as it calls ``fully_shard``. Only the reduce-scatter (the
built-in, quantized or custom one) moves: gathers stay on the shard group and the
all-reduce across replicas on the replicate group. The ledger enters such a
reduce-scatter as one on its own group (core/guard/ledger.py), so ranks that disagree on the
setting are named by the divergence guard instead of hanging on two different groups.
``False`` goes back to the shard group.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from .staging import PROCESS_GROUP_STAGING, ProcessGroupStaging, SymmetricStaging
from .refusals.torch_errors import FullyShardArgumentError, torch_first


@dataclasses.dataclass(frozen=True)
class CommOptions:
    """A group's communication settings (torch's FSDPModule setters; defaults: none).

    reduce_pg: the process group its gradient reduce-scatters run on, or None for the
        shard group (Note [a reduce-scatter group of its own]).
    reduces_in_flight: how many of the root's reductions may be in flight when the next
        one starts (``set_reduce_scatter_max_input_buffers``); the root keeps the largest
        of its groups', as torch keeps one per communication context.
    gather_staging, reduce_staging: where the all-gather's output and the reduce-scatter's
        input come from instead of the pool (core/staging.py), or None.
    """

    reduce_pg: dist.ProcessGroup | None = None
    reduces_in_flight: int = 1
    gather_staging: object = None
    reduce_staging: object = None


DEFAULT_COMM = CommOptions()


def check_reduces_in_flight(value, name: str, *, wrong_type: type[Exception] = TypeError
                            ) -> None:
    """Refuse ``value`` unless it is an int >= 1 (``CommOptions.reduces_in_flight``), naming
    it ``name``: ``wrong_type`` for one that is no int (``True`` included), ValueError for
    one below 1. The setter raises TypeError as torch's does; the estimate ValueError for
    both, as for every bad argument it takes."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(f"{name} must be an int >= 1 (how many gradient reductions may be "
                         f"in flight), got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1 (how many gradient reductions may be "
                         f"in flight), got {value!r}")


def separate_reduce_groups(groups: list, enable: bool) -> None:
    """Give each of ``groups`` (ParamGroups, in the same order on every rank) a
    reduce-scatter group of its own, or (``enable`` False) none (Note [a reduce-scatter
    group of its own])."""
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for group in groups:
        options = group.comm_options
        if not enable:
            group.comm_options = dataclasses.replace(options, reduce_pg=None)
            continue
        ranks = tuple(dist.get_process_group_ranks(group.pg))
        if ranks not in made:
            made[ranks] = options.reduce_pg or dist.new_group(
                list(ranks), use_local_synchronization=True,
                group_desc="fullshard_reduce_scatter")
        group.comm_options = dataclasses.replace(options, reduce_pg=made[ranks])


def groups_of(unit, units: list, method: str) -> list:
    """The groups of ``units`` (UnitStates) and the batches gathering them, each once, in
    order; refused (E303) when one of them was batched at the first forward with a unit
    outside ``units``, whose settings would change too."""
    changing = set(units)
    groups = list(dict.fromkeys(g for u in units for g in (u.group, u.batch) if g is not None))
    root = unit.root
    for group in {u.batch for u in units if u.batch is not None} if root is not None else ():
        others = [u.name for u in root.members[group] if u not in changing]
        if others:
            raise ValueError(
                f"{method} on {unit.name}: its parameters were merged with "
                f"{', '.join(others)} into one collective at the first forward, so its "
                "communication settings cannot differ from theirs. Call it before the first "
                "forward, or on a module that contains them all.")
    return groups


def change(unit, units: list, method: str, **changes) -> None:
    """Change the communication settings of ``units``' groups (``groups_of``)."""
    for group in groups_of(unit, units, method):
        group.comm_options = dataclasses.replace(group.comm_options, **changes)
    if unit.root is not None:
        unit.root.update_reduces_in_flight()


def allocate_from_process_group(unit, units: list, enable: bool) -> None:
    """``set_allocate_memory_from_process_group_for_comm`` on ``units`` (Note [staging
    buffers from the process group])."""
    method = "set_allocate_memory_from_process_group_for_comm"
    groups = groups_of(unit, units, method)
    for group in groups:
        _refuse_beside_others(group, unit.name, method,
                              "set_allocate_memory_from_process_group", ProcessGroupStaging)
    staging = PROCESS_GROUP_STAGING if enable else None
    change(unit, units, method, gather_staging=staging, reduce_staging=staging)


def use_symmetric_memory(unit, units: list, backend: str) -> None:
    """``set_symm_mem_for_comm(backend)`` on ``units``: their all-gathers' outputs in
    symmetric memory (Note [staging buffers from the process group])."""
    method = "set_symm_mem_for_comm"
    groups = groups_of(unit, units, method)
    for group in groups:
        _refuse_beside_others(group, unit.name, method, "set_symm_mem", SymmetricStaging)
    for group in groups:
        try:
            staging = SymmetricStaging(group.pg, backend, group.compute_device)
        except RuntimeError as err:
            raise RuntimeError(torch_first(
                str(err), f"fullshard: {method} on {unit.name}: symmetric memory needs a torch "
                "built with it, CUDA devices and an NCCL process group; leave it off here "
                "(the all-gathers then use fullshard's pooled buffers).")) from err
        group.comm_options = dataclasses.replace(group.comm_options, gather_staging=staging)


def _refuse_beside_others(group, unit_name: str, method: str, torch_method: str,
                          allowed) -> None:
    """torch refuses these setters where the unit's collective is replaced: a custom
    collective, or the other setter's buffers (E300, E301); its message comes first."""
    options = group.comm_options
    for kind, comm, staging, custom in (
            ("all gather", group.all_gather_comm, options.gather_staging,
             "set_custom_all_gather"),
            ("reduce scatter", group.reduce_scatter_comm, options.reduce_staging,
             "set_custom_reduce_scatter")):
        if comm is not None:
            other, source = type(comm).__name__, f"{custom}({type(comm).__name__})"
        elif staging is not None and not isinstance(staging, allowed):
            other, source = staging.torch_names[kind], staging.setter
        else:
            continue
        raise FullyShardArgumentError(torch_first(
            f"cannot call {torch_method}() when {kind} comm is custom: {other}",
            f"fullshard: {method} on {unit_name}: the unit's {kind.replace(' ', '-')} "
            f"buffers are already chosen by {source}; use one of the two."))
