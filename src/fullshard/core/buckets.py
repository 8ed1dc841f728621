"""Merge small adjacent units into one communication group.

Note [buckets: units share a group]
A unit (one ``fully_shard`` call) is where hooks run; a ParamGroup is what one
collective moves. Usually they are one to one. But a collective has a fixed cost
(gloo: ~0.3 ms at world size 2 whatever the size below ~50K floats), so a model of
many small blocks spends its step in latency. At lazy init the root merges runs
of adjacent units (in module order, the order transformers run in) whose
unsharded size stays under ``bucket_numel`` into one group: one all-gather, one
reduce-scatter for the whole run. A merged group is gathered when its first
member needs it, freed after forward once every member has run (ZeRO-3), and
reduced once every member's gradients are in. Units merge only when they agree on
mesh, dtype, mixed-precision policy, ``reshard_after_forward`` and communication
settings (core/comm_groups.py); small units next to the root may join
the root's group and then follow the root's rule (stay gathered from forward to
backward, at most ``bucket_numel`` elements), which saves the first gather of the
backward. ``bucket_numel=0`` turns merging off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .group import ParamGroup
from .schedule import AfterForward, joins_bucket, plan_runs

if TYPE_CHECKING:
    from .state import UnitState


def plan_buckets(units: "list[UnitState]", bucket_numel: int,
                 root: "UnitState | None" = None) -> "list[list[UnitState]]":
    """Runs of adjacent, compatible units whose unsharded sizes sum to <= bucket_numel."""
    return plan_runs([u for u in units if u.group is not None],
                     lambda u: u.group.world_size * u.group.storage.numel,
                     lambda first, u: _compatible(first, u, root), bucket_numel)


def _compatible(a: "UnitState", b: "UnitState", root: "UnitState | None") -> bool:
    ga, gb = a.group, b.group
    same_rule = joins_bucket(AfterForward(a.reshard_after_forward, ga.post_forward_size),
                             a is root, AfterForward(b.reshard_after_forward, gb.post_forward_size))
    same_reduce = (a.reduce_options == b.reduce_options
                   and a.unshard_in_backward == b.unshard_in_backward)
    return (a.mesh == b.mesh and same_rule and same_reduce and a.mp_policy == b.mp_policy
            and ga.flat_shard.dtype == gb.flat_shard.dtype
            and ga.flat_shard.device == gb.flat_shard.device
            and (ga.offload, ga.compute_device) == (gb.offload, gb.compute_device)
            and (ga.quantize_weights, ga.quantize_grads) == (gb.quantize_weights,
                                                             gb.quantize_grads)
            and ga.comm_options == gb.comm_options)


def merge_small_units(units: "list[UnitState]", bucket_numel: int,
                      root: "UnitState | None" = None) -> None:
    """Give each run of small units one shared, freshly laid out ParamGroup."""
    if bucket_numel <= 0:
        return
    # Units the user gave explicit prefetch orders to (or named as targets) keep their
    # own groups: the user chose that granularity.
    pinned = {t for u in units for t in (u.forward_prefetch or []) + (u.backward_prefetch or [])}
    pinned |= {u for u in units if u.forward_prefetch or u.backward_prefetch}
    # Units sharded together by one fully_shard([...]) call already share a group.
    pinned |= {u for u in units if len(u.created_with) > 1}
    # A custom collective serves its own unit only (Note [custom collectives]).
    pinned |= {u for u in units if u.group is not None and (
        u.group.all_gather_comm is not None or u.group.reduce_scatter_comm is not None)}
    # Tensor-subclass parameters gather beside the flat buffers (Note [tensor-subclass
    # parameters]); their units keep their own group.
    pinned |= {u for u in units if u.group is not None and u.group.subclass is not None}
    for run in plan_buckets([u for u in units if u not in pinned], bucket_numel, root):
        if len(run) == 1:
            continue
        params = [p for u in run for p in u.group.params]
        name = f"{run[0].name}..{run[-1].name}"
        first = run[0].group
        merged = ParamGroup(params, first.pg, name, first.param_dtype, first.reduce_dtype,
                            first.replicate_pg, first.post_forward_size,
                            offload=first.offload, compute_device=first.compute_device)
        merged.unsharded.keep_storage = any(u.group.unsharded.keep_storage
                                               for u in run)
        merged.quantize_weights, merged.quantize_grads = first.quantize_weights, first.quantize_grads
        merged.comm_options = first.comm_options  # core/comm_groups.py
        merged.readopt()  # one flat shard for the run; DTensors re-pointed at its views
        for u in run:
            u.group.retire(merged_into=merged)
            u.group = merged
