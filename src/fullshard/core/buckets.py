"""Gather small adjacent units together: which units join one batch (core/batch.py).

Note [buckets: units gather together]
A unit (one ``fully_shard`` call) is where hooks run and owns one ParamGroup: its
parameters and their flat shard, for life. A collective has a fixed cost (gloo: ~0.3 ms
at world size 2 whatever the size below ~50K floats), so a model of many small blocks
spends its step in latency. At lazy init the root puts runs of adjacent units (in module
order, the order transformers run in) whose unsharded size stays under ``bucket_numel``
into one ``GatherBatch``: one all-gather and one reduce-scatter for the whole run (Note
[a batch reads its members' shards]). Nothing is re-pointed: each unit's group, its
flat shard and the DTensors viewing it stay as ``fully_shard`` made them, so an
optimizer built before the first forward and code holding ``unit.group`` go on working
with them. The schedule asks which batch a unit's group belongs to (``UnitState.batch``;
a unit alone is its own batch). A batch is gathered when its first member needs it,
freed after forward once every member has run (ZeRO-3), and reduced once every member's
gradients are in. Units join one batch only when they agree on mesh, dtype,
mixed-precision policy, ``reshard_after_forward`` and communication settings
(core/comm_groups.py); small units next to the root may join the root's batch and then
follow the root's rule (stay gathered from forward to backward, at most
``bucket_numel`` elements), which saves the first gather of the backward.
``bucket_numel=0`` turns batching off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .batch import GatherBatch
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
            and ga.storage.dtype == gb.storage.dtype
            and ga.reduce_dtype == gb.reduce_dtype  # a grad_dtype may widen one's
            and ga.storage.device == gb.storage.device
            and (ga.offload, ga.compute_device) == (gb.offload, gb.compute_device)
            and (ga.quantize_weights, ga.quantize_grads) == (gb.quantize_weights,
                                                             gb.quantize_grads)
            and ga.comm_options == gb.comm_options)


def merge_small_units(units: "list[UnitState]", bucket_numel: int,
                      root: "UnitState | None" = None) -> None:
    """Put each run of small units into one GatherBatch (their groups stay theirs)."""
    if bucket_numel <= 0:
        return
    # Units the user gave explicit prefetch orders to (or named as targets) are gathered
    # alone: the user chose that granularity.
    pinned = {t for u in units for t in (u.forward_prefetch or []) + (u.backward_prefetch or [])}
    pinned |= {u for u in units if u.forward_prefetch or u.backward_prefetch}
    # Units sharded together by one fully_shard([...]) call already share a group.
    pinned |= {u for u in units if len(u.created_with) > 1}
    # A custom collective serves its own unit only (Note [custom collectives]).
    pinned |= {u for u in units if u.group is not None and (
        u.group.all_gather_comm is not None or u.group.reduce_scatter_comm is not None)}
    # Tensor-subclass parameters gather beside the flat buffers (Note [tensor-subclass
    # parameters]); their units are gathered alone.
    pinned |= {u for u in units if u.group is not None and u.group.subclass is not None}
    for run in plan_buckets([u for u in units if u not in pinned], bucket_numel, root):
        if len(run) > 1:
            GatherBatch([u.group for u in run], f"{run[0].name}..{run[-1].name}")
