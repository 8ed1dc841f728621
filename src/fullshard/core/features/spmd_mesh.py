"""The whole SPMD mesh given with ``dp_mesh_dims``: which of its dimensions are data
parallel, the mesh fullshard shards and reduces over, and where a parameter lives once
sharded.

Note [data-parallel dimensions of an SPMD mesh]
``fully_shard(m, mesh=world_mesh, dp_mesh_dims=DataParallelMeshDims(shard=...,
replicate=...))`` takes parameters that are DTensors on ``world_mesh``, ``Replicate()``
on its data-parallel dimensions. Each of ``shard`` and ``replicate`` may name several
dimensions (listed in the mesh's order); torch's FSDP2 then works on their product,
flattened with ``DeviceMesh._flatten`` (named by joining the names with ``_``), so the
ranks follow the mesh's row-major order. fullshard builds the same meshes:

* shard only: the flattened shard dimensions are the 1-D mesh a unit gathers over;
* shard and replicate: the 2-D ``(replicate, shard)`` mesh of hybrid sharding, each of
  its dimensions the product of the names given (``DeviceMesh._concatenate``, so the
  replicate dimension may come after the shard one in the mesh);
* replicate only (DDP-like): every rank keeps each parameter whole and gradients are
  all-reduced over the replicate product. fullshard runs that as hybrid sharding over a
  shard dimension of one rank (gathering over one rank copies nothing away), on a mesh
  made once per replicate layout (``_unflatten``, which creates process groups, is not
  cached by torch).

What the parameter is once sharded is torch's, placement for placement: with one shard
dimension a DTensor on the whole mesh, ``Shard(0)`` (or ``_StridedShard`` when later
dimensions also split dim 0) on that dimension, everything else as given; with several,
a DTensor on the mesh whose consecutive shard dimensions are replaced by the flattened
one (under hybrid sharding by the ``(replicate, shard)`` pair, the replicate dimensions
dropped). torch builds that mesh by walking the dimensions, so shard dimensions with
another between them overlap there and are refused, as torch refuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from .tensor_parallel import TensorParallelLayout, dp_placement, refuse_partial
from ..refusals.torch_errors import torch_first

# Process-global because process groups are: every unit replicated over the same group
# shares one (replicate, one-rank shard) mesh instead of creating groups of its own
# (Note [data-parallel dimensions of an SPMD mesh]). Keyed by the replicate mesh and its
# group's name (equal meshes may run on groups made apart, e.g. another backend).
_REPLICATE_ONLY: dict[tuple[DeviceMesh, str], DeviceMesh] = {}


def _flattened(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The product of ``names`` as one dimension, as torch's FSDP2 flattens it."""
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


def _replicate_only(replicate: DeviceMesh) -> DeviceMesh:
    """``(replicate, one-rank shard)``: hybrid sharding that keeps parameters whole."""
    key = (replicate, replicate.get_group(0).group_name)
    if key not in _REPLICATE_ONLY:
        name = replicate.mesh_dim_names[0]
        _REPLICATE_ONLY[key] = replicate._unflatten(
            0, (replicate.size(), 1), (name, f"{name}_whole"))
    return _REPLICATE_ONLY[key]


@dataclass(frozen=True)
class SpmdDims:
    """``fully_shard(mesh=world_mesh, dp_mesh_dims=...)``: the whole mesh, the names of its
    shard and replicate dimensions, the mesh a unit gathers and reduces over, and the mesh
    its sharded parameters live on (Note [data-parallel dimensions of an SPMD mesh])."""

    mesh: DeviceMesh
    shard: tuple[str, ...]
    replicate: tuple[str, ...]
    dp_mesh: DeviceMesh = field(init=False)
    sharded_mesh: DeviceMesh = field(init=False)

    def __post_init__(self):
        shard = _flattened(self.mesh, self.shard) if self.shard else None
        replicate = _flattened(self.mesh, self.replicate) if self.replicate else None
        if shard is None:
            dp_mesh = _replicate_only(replicate)
        elif replicate is None:
            dp_mesh = shard
        else:
            dp_mesh = DeviceMesh._concatenate([replicate, shard])
        object.__setattr__(self, "dp_mesh", dp_mesh)
        object.__setattr__(self, "sharded_mesh", self._sharded_mesh())

    def _sharded_mesh(self) -> DeviceMesh:
        """The whole mesh with its shard dimensions flattened in place (one: itself)."""
        if len(self.shard) <= 1:
            return self.mesh
        parts: list[DeviceMesh] = []
        skip = 0
        for name in self.mesh.mesh_dim_names:
            # torch's walk: the first shard name stands for all of them, the names after
            # it are skipped whatever they are
            if skip:
                skip -= 1
            elif name in self.shard:
                parts.append(self.dp_mesh)
                skip = len(self.shard) - 1
            elif name not in self.replicate:
                parts.append(self.mesh[name])
        return DeviceMesh._concatenate(parts)

    def index(self, name: str) -> int:
        return self.mesh.mesh_dim_names.index(name)

    def indices(self) -> tuple[int, ...]:
        """The data-parallel dimensions of the whole mesh (their gradients are reduced by
        fullshard, not redistributed)."""
        return tuple(self.index(n) for n in self.shard + self.replicate)


def spmd_layout(spmd: SpmdDims, spec: DTensorSpec, where: str, dim: int
                ) -> TensorParallelLayout:
    """Where a DTensor parameter on the whole mesh lives once sharded on ``dim``, placed
    as torch's FSDP2 places it (Note [data-parallel dimensions of an SPMD mesh])."""
    refuse_partial(spec, where)
    if spec.mesh != spmd.mesh:
        raise ValueError(f"{where}, but fully_shard was given mesh {spmd.mesh} with "
                         "dp_mesh_dims; every parameter must be a DTensor on that mesh.")
    given = spec.placements
    names = spmd.mesh.mesh_dim_names
    for kind, dims in (("shard", spmd.shard), ("replicate", spmd.replicate)):
        for i in map(spmd.index, dims):
            if not isinstance(given[i], Replicate):
                # torch's words first: callers match them (docs/errors.md E335)
                raise ValueError(torch_first(
                    f"Expected Replicate() on DP {kind} dim '{names[i]}' (index {i}) but "
                    f"got {given[i]}", f"{where} with {given[i]} on data-parallel "
                    f"dimension '{names[i]}'; it must be Replicate() there (distribute it "
                    "with Replicate() on the data-parallel dimensions)."))
    placements = list(given)
    for i in map(spmd.index, spmd.shard):
        split = math.prod(spmd.mesh.size(j) for j in range(i + 1, spmd.mesh.ndim)
                          if isinstance(given[j], (Shard, _StridedShard))
                          and given[j].dim == dim)
        placements[i] = dp_placement(dim, split)
    dp_indices = frozenset(spmd.indices())
    if len(spmd.shard) <= 1:
        return TensorParallelLayout(spmd.mesh, tuple(placements), dp_indices)
    first = spmd.index(spmd.shard[0])
    hybrid = (Replicate(),) if spmd.replicate else ()
    kept = [(*hybrid, placements[i]) if i == first else (placements[i],)
            for i in range(spmd.mesh.ndim)
            if i == first or (names[i] not in spmd.shard and names[i] not in spmd.replicate)]
    return TensorParallelLayout(spmd.sharded_mesh, sum(kept, ()), dp_indices)
