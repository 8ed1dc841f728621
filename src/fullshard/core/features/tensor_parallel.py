"""Parameters that are already DTensors on a tensor-parallel mesh (FSDP + TP, 2-D).

Note [sharding a tensor-parallel parameter]
After ``parallelize_module(block, world_mesh["tp"], plan)`` a parameter is a DTensor
on the TP mesh whose local tensor is this rank's TP piece (e.g. ``ColwiseParallel``:
``Shard(0)``; ``RowwiseParallel``: ``Shard(1)``, its bias ``Replicate()``).
``fully_shard(block, mesh=world_mesh["dp"])`` then treats that *local* tensor as the
parameter to shard: it is split on dim 0 across the data-parallel ranks exactly like a
plain parameter (Note [padded dim-0 shards]), gathered over the data-parallel group
only, and its gradient reduce-scattered over that group only (TP ranks hold different
pieces, so nothing is summed across them).

What the model and the user see:
* while sharded, one DTensor on the joint ``(dp, tp)`` mesh with placements
  ``(dp placement, *tp placements)``. When TP also splits dim 0, the data-parallel
  split is taken *inside* each TP piece, which DTensor spells
  ``_StridedShard(0, split_factor=<TP pieces on dim 0>)``; otherwise it is
  ``Shard(0)``. ``full_tensor()``, DCP and ``clip_grad_norm_`` see the true global
  parameter;
* while unsharded (forward, backward), the original TP DTensor again: its local
  tensor is a view of the unit's gathered buffer, so the TP plan's hooks work as they
  did before sharding;
* gradients arrive as TP DTensors; placements other than the parameter's own (e.g. a
  ``Partial`` gradient of a replicated bias) are redistributed to them first, and the
  local tensor is what is reduced.

torch's FSDP2 lays the parameter out the same way, so state dicts are interchangeable.

torch 2.13's other spelling, ``fully_shard(m, mesh=world_mesh,
dp_mesh_dims=DataParallelMeshDims(shard="dp"))``, passes the whole mesh instead: every
parameter is then a DTensor on that mesh, ``Replicate()`` on its data-parallel
dimensions. The same layout follows, written on the parameter's own mesh: the
data-parallel dimension's ``Replicate()`` becomes ``Shard(0)``, or ``_StridedShard`` when
dimensions after it also split dim 0 (Note [data-parallel dimensions of an SPMD mesh]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, _StridedShard



def is_foreign_dtensor(p: torch.Tensor, dp_mesh: DeviceMesh) -> bool:
    """Whether ``p`` is a DTensor on a mesh disjoint from the data-parallel one (tensor
    parallel), as opposed to one fullshard already sharded over ``dp_mesh``."""
    if not isinstance(p, DTensor):
        return False
    dp_groups = set(map(id, dp_mesh.get_all_groups()))
    return not any(id(g) in dp_groups for g in p.device_mesh.get_all_groups())


@dataclass(frozen=True)
class TensorParallelLayout:
    """Where a TP parameter lives once sharded, and which of its gradient's mesh
    dimensions are data parallel (left to the reduce-scatter, not redistributed)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    dp_indices: frozenset[int] = frozenset()


def refuse_partial(spec: DTensorSpec, where: str) -> None:
    """A parameter's DTensor placements cannot be ``Partial`` (nothing to shard)."""
    if any(isinstance(pl, Partial) for pl in spec.placements):
        raise ValueError(f"{where} with placements {spec.placements}; a parameter cannot "
                         "be Partial. Give it Shard or Replicate placements.")


def sharded_layout(dp_mesh: DeviceMesh, tp_spec: DTensorSpec, where: str, dim: int = 0
                   ) -> TensorParallelLayout:
    """The mesh and placements of a TP parameter once its local piece is sharded on
    ``dim`` over ``dp_mesh`` (``where`` names the unit, the parameter and its mesh)."""
    tp_mesh = tp_spec.mesh
    refuse_partial(tp_spec, where)
    if tp_mesh.ndim > 2:
        raise NotImplementedError(f"{where}: fullshard combines data parallelism with a 1-D "
                                  "or 2-D model-parallel mesh (TP, EP+TP), not "
                                  f"{tp_mesh.ndim}-D.")
    if not dp_mesh.mesh_dim_names or not tp_mesh.mesh_dim_names:
        raise ValueError(
            f"{where}; to shard it over the data-parallel mesh as well, both must be named "
            "dimensions of one mesh: build it with init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')) and pass mesh=world_mesh['dp'] to fully_shard and "
            "world_mesh['tp'] to parallelize_module.")
    try:
        joint = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except RuntimeError:
        raise ValueError(
            f"{where}, which is not a dimension of the same mesh as the data-parallel mesh "
            f"{dp_mesh}. Take both from one init_device_mesh(...) result, e.g. "
            "world_mesh['dp'] and world_mesh['tp'].") from None
    split = tp_spec.num_shards_map[dim]
    lead = (Replicate(),) if dp_mesh.ndim == 2 else ()  # hybrid: (replicate, shard, *tp)
    return TensorParallelLayout(joint, (*lead, dp_placement(dim, split), *tp_spec.placements))


def dp_placement(dim: int, split: int) -> Placement:
    """Shard(dim) over the data-parallel ranks, taken inside each of ``split`` pieces that
    later mesh dimensions cut ``dim`` into."""
    return _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)


def local_grad(grad: torch.Tensor, tp_spec: DTensorSpec,
               dp_indices: frozenset[int] = frozenset()) -> torch.Tensor:
    """The local tensor of a TP parameter's gradient, in the parameter's own placements
    except on data-parallel dimensions (what those hold is the reduce-scatter's input)."""
    if not isinstance(grad, DTensor):
        raise TypeError(f"fullshard: expected the gradient of a tensor-parallel parameter to "
                        f"be a DTensor, got {type(grad).__name__}.")
    target = tuple(grad.placements[i] if i in dp_indices else pl
                   for i, pl in enumerate(tp_spec.placements))
    if grad.placements != target:
        grad = grad.redistribute(tp_spec.mesh, target)
    local = grad._local_tensor
    wait = getattr(local, "wait", None)  # AsyncCollectiveTensor from a redistribute
    return wait() if callable(wait) else local


def refuse_unrelated_tp_mesh(label: str, fqn: str, p: DTensor, dp_mesh: DeviceMesh,
                             spmd: bool) -> None:
    """Raise if ``p`` lives on a mesh made apart from ``dp_mesh`` that nonetheless shares
    its process groups (two ``init_device_mesh`` calls over the same ranks reuse the
    default group): it is neither a dimension of one parent mesh with ``dp_mesh`` nor
    ``dp_mesh`` itself, so no joint layout of the two exists. ``spmd``: the whole mesh
    came with ``dp_mesh_dims``, where parameters live on it by design."""
    tp_mesh = p.device_mesh
    if spmd or tp_mesh == dp_mesh or is_foreign_dtensor(p, dp_mesh):
        return
    raise ValueError(
        f"fully_shard({label}): parameter '{fqn}' is a DTensor on mesh {tp_mesh}, which was "
        f"made apart from the data-parallel mesh {dp_mesh} given to fully_shard, not as "
        "another dimension of one parent mesh. Make both from one init_device_mesh(device, "
        "(dp, tp), mesh_dim_names=('dp', 'tp')): parallelize_module(..., world_mesh['tp'], "
        "plan), then fully_shard(..., mesh=world_mesh['dp']).")
