"""Which DeviceMesh a sharding strategy runs on.

NO_SHARD and the hybrid strategies are two-dimensional (replicate, shard) meshes:
NO_SHARD is (world, 1), one rank per shard group (Note [shard groups of one rank] in
core/group.py); HYBRID_SHARD shards within a node and replicates across nodes.
Meshes are cached: a model wrapped unit by unit (``FSDP(layer)`` per layer, then the
root) must not create a new set of process groups per call, and units on one mesh can
share collectives.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..core.mesh import default_process_group_or_raise
from .options import ShardingStrategy

HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
# (device type, shape or ranks) -> the mesh built for it. Process-wide because building a
# mesh creates process groups, a collective every rank must join in the same order: each
# FSDP(...) of the same strategy must reuse one mesh, not create groups per wrapped unit.
_MESHES: dict[tuple, DeviceMesh] = {}


def resolve_mesh(strategy: ShardingStrategy, process_group, device_mesh: DeviceMesh | None,
                 device_type: str) -> DeviceMesh:
    """The mesh for ``strategy`` from the FSDP1 arguments."""
    where = "FullyShardedDataParallel"
    hybrid = strategy in HYBRID
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError(f"{where}: pass process_group or device_mesh, not both.")
        want = 2 if hybrid else 1
        if device_mesh.ndim != want:
            raise ValueError(
                f"{where}: sharding_strategy={strategy.name} needs a {want}-D device_mesh, got "
                f"{device_mesh.ndim}-D {tuple(device_mesh.shape)}"
                + (" (replicate, shard)." if hybrid else "; use HYBRID_SHARD for a 2-D mesh."))
        if strategy is not ShardingStrategy.NO_SHARD:
            return _named(device_mesh) if hybrid else device_mesh
        process_group = device_mesh.get_group(0)
    if isinstance(process_group, tuple):
        if not hybrid:
            raise ValueError(f"{where}: a process-group pair is for the hybrid strategies; "
                             f"sharding_strategy={strategy.name} takes one process group.")
        return _mesh_from_pair(process_group, device_type)
    default_process_group_or_raise(where)
    pg = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size()
    if strategy is ShardingStrategy.NO_SHARD or hybrid:
        if pg.size() != world:
            raise ValueError(
                f"{where}: {strategy.name} over a process group of {pg.size()} of {world} ranks "
                "needs an explicit device_mesh (a 2-D (replicate, shard) mesh over those ranks).")
        shard = 1 if strategy is ShardingStrategy.NO_SHARD else ranks_per_node(world)
        return _cached(device_type, (world // shard, shard))
    if pg.size() == world:
        return _cached(device_type, (world,))
    key = (device_type, "group", tuple(dist.get_process_group_ranks(pg)))
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(pg, device_type)
    return _MESHES[key]


def _mesh_from_pair(pair: tuple, device_type: str) -> DeviceMesh:
    """The (replicate, shard) mesh of an (intra-node, inter-node) process-group pair, as
    FSDP1's hybrid strategies take it: rows are the intra-node (shard) groups, columns
    the inter-node (replicate) ones. Every rank shares its intra group's ranks once."""
    if len(pair) != 2 or not all(isinstance(g, dist.ProcessGroup) for g in pair):
        raise TypeError("FullyShardedDataParallel: process_group for a hybrid strategy is one "
                        "ProcessGroup or an (intra-node, inter-node) pair of them.")
    intra, inter = pair
    key = (device_type, "pair", id(intra), id(inter))
    if key in _MESHES:
        return _MESHES[key]
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, dist.get_process_group_ranks(intra))
    groups = sorted({tuple(r) for r in rows})
    inter_ranks = dist.get_process_group_ranks(inter)
    grid = len({len(g) for g in groups}) == 1
    mesh = torch.tensor(groups) if grid else None
    if grid:
        column = (mesh == dist.get_rank()).nonzero()[0, 1].item()
        grid = sorted(mesh[:, column].tolist()) == sorted(inter_ranks)
    if not grid:
        raise ValueError(
            f"FullyShardedDataParallel: the process-group pair does not form a grid: the "
            f"intra-node groups are {[list(g) for g in groups]} and this rank's inter-node "
            f"group is {inter_ranks}. Pass device_mesh=init_device_mesh(device_type, "
            "(num_nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard')) instead.")
    _MESHES[key] = DeviceMesh.from_group([inter, intra], device_type, mesh=mesh,
                                         mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


def _named(mesh: DeviceMesh) -> DeviceMesh:
    """A 2-D mesh with its dimensions named (replicate, shard): torch's FSDP1 takes them by
    position, fully_shard (as torch's) wants them named."""
    if mesh.mesh_dim_names is not None:
        return mesh
    key = (mesh.device_type, "unnamed", tuple(mesh.mesh.flatten().tolist()), mesh.mesh.shape)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group([mesh.get_group(0), mesh.get_group(1)],
                                             mesh.device_type, mesh=mesh.mesh,
                                             mesh_dim_names=("replicate", "shard"))
    return _MESHES[key]


def _cached(device_type: str, shape: tuple[int, ...]) -> DeviceMesh:
    key = (device_type, shape, id(dist.group.WORLD))
    if key not in _MESHES:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _MESHES[key]


def ranks_per_node(world: int) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else the GPUs here, else all."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None:
        n = int(local)
    elif torch.cuda.is_available():
        n = torch.cuda.device_count()
    else:
        n = world
    n = min(n, world)
    if n < 1 or world % n:
        raise ValueError(
            f"FullyShardedDataParallel: HYBRID_SHARD shards within a node of {n} ranks, which "
            f"does not divide the world size {world}; pass device_mesh=init_device_mesh(..., "
            "(replicas, shard_size), mesh_dim_names=('replicate', 'shard')).")
    return n
