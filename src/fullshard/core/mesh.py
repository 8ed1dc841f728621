"""Device meshes: the default one, the device a mesh computes on, torch's
``dp_mesh_dims`` (which named dimensions of a mesh are data parallel), and whether the
units under one root can run together on their meshes (``check_units_fit_root``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .features.spmd_mesh import SpmdDims
from .refusals.torch_errors import FullyShardArgumentError, torch_first


def default_process_group_or_raise(what: str) -> None:
    """Raise, naming ``what``, unless a default process group is initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what}: no process group is initialized. Call "
            "torch.distributed.init_process_group(backend) first (gloo on CPU, nccl on CUDA), "
            "for example under `torchrun --nproc_per_node N train.py`, or pass mesh=.")


def mesh_device_type() -> str:
    """The device type of the default process group's mesh (cuda only with nccl)."""
    backend = dist.get_backend()
    if "nccl" in backend and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def resolve_mesh(label: str, mesh: DeviceMesh | None) -> DeviceMesh:
    """``mesh`` checked (1-D, or 2-D for hybrid sharding; this rank in it), or the
    default: every rank of the default process group."""
    if mesh is None:
        default_process_group_or_raise(f"fully_shard({label})")
        return init_device_mesh(mesh_device_type(), (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard({label}): mesh must be a torch DeviceMesh, got "
                        f"{type(mesh).__name__}.")
    if mesh.ndim not in (1, 2):
        raise ValueError(torch_first(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}",
            f"fully_shard({label}): mesh has {mesh.ndim} dimensions {tuple(mesh.shape)}; "
            "fullshard shards over a 1-D mesh, or a 2-D (replicate, shard) mesh for hybrid "
            "sharding. Pass those dimensions, e.g. mesh['replicate', 'shard']."))
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise FullyShardArgumentError(torch_first(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified",
            f"fully_shard({label}): a 2-D mesh {tuple(mesh.shape)} is sharded on its second "
            "dimension and replicated across its first; name them, e.g. init_device_mesh("
            "device_type, (replicas, shards), mesh_dim_names=('replicate', 'shard'))."))
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard({label}): this rank ({dist.get_rank()}) is not in the mesh (ranks "
            f"{mesh.mesh.flatten().tolist()}) of world size {dist.get_world_size()}; every rank "
            "that runs the model must be in its mesh. Build the mesh over those ranks, e.g. "
            "init_device_mesh(device_type, (world_size,)).")
    return mesh


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh``."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def data_parallel_mesh(label: str, mesh: DeviceMesh | None, dp_mesh_dims
                       ) -> SpmdDims | None:
    """torch's ``dp_mesh_dims``: which named dimensions of ``mesh`` are data parallel."""
    if dp_mesh_dims is None:
        return None
    if mesh is None:
        raise ValueError(f"fully_shard({label}): dp_mesh_dims needs the mesh it names; pass "
                         "mesh= as well.")
    replicate = _dim_names(dp_mesh_dims.replicate)
    shard = _dim_names(dp_mesh_dims.shard)
    names = mesh.mesh_dim_names or ()
    for name in shard + replicate:
        if name not in names:  # torch's words first: callers match them (docs/errors.md E336)
            raise ValueError(torch_first(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}",
                f"fully_shard({label}): dp_mesh_dims {dp_mesh_dims} names a dimension the "
                "mesh does not have; name dimensions of the mesh passed as mesh= (the one "
                "the parameters are DTensors on)."))
    if not shard and not replicate:  # torch fails flattening none (docs/errors.md E361)
        raise RuntimeError(torch_first(
            "Cannot flatten a DeviceMesh without mesh_dim_names!",
            f"fully_shard({label}): dp_mesh_dims {dp_mesh_dims} names no dimension; name "
            "the mesh's data-parallel dimensions in shard= or replicate=."))
    try:
        return SpmdDims(mesh, shard, replicate)
    except (KeyError, RuntimeError) as err:  # torch's words first (docs/errors.md E360)
        raise type(err)(torch_first(
            err.args[0] if err.args else str(err),
            f"fully_shard({label}): dp_mesh_dims {dp_mesh_dims} on the mesh {names}: name "
            "each dimension once, in the mesh's order, shard and replicate apart, and the "
            "shard dimensions side by side (torch flattens them into one)."
            )) from None


def _dim_names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


# Whether the units under one root can run together on their meshes.
#
# Units of one model may use different meshes: experts on an expert-data-parallel mesh
# (``world_mesh['efsdp']``) beside dense layers on the whole data-parallel mesh, their
# weights expert-parallel (DTensors ``Shard(0)`` on ``world_mesh['ep']``). Two layouts
# cannot work, and are refused at the first forward, on every rank alike (the meshes are
# slices of one mesh, so every rank finds the same mismatch):
#
# * a unit whose mesh reaches ranks outside its root's: those ranks run another model's
#   collectives (or none) when this unit gathers;
# * a parameter whose shards cover only part of the root's ranks (a plain parameter on a
#   sub-mesh): the ranks outside hold another copy whose gradients are never averaged with
#   these, and a checkpoint could not tell the copies apart (they share one name).


def _ranks(mesh: DeviceMesh) -> list[int]:
    return sorted(mesh.mesh.flatten().tolist())


def check_units_fit_root(root, units) -> None:
    """Raise, naming the unit and the meshes, when a unit's mesh or a parameter's shards
    do not fit the root's mesh (``root`` and ``units`` are UnitStates)."""
    root_ranks = _ranks(root.mesh)
    for unit in units:
        if unit is root or unit.group is None:
            continue
        unit_ranks = _ranks(unit.mesh)
        outside = sorted(set(unit_ranks) - set(root_ranks))
        if outside:
            raise ValueError(
                f"fully_shard({unit.name}): its mesh spans ranks {unit_ranks}, but its root "
                f"{root.name} runs on ranks {root_ranks}: rank(s) {outside} would never run "
                "this unit's collectives with the others. Take both meshes from one "
                "init_device_mesh(...) result, the unit's a part of the root's (e.g. "
                "world_mesh['efsdp'] for experts, world_mesh['dp'] for the rest).")
        for p in unit.own_params:
            covered = _ranks(p.spec.mesh)
            missing = sorted(set(root_ranks) - set(covered))
            if missing:
                raise ValueError(
                    f"fully_shard({unit.name}): parameter '{p.fqn}' is sharded over ranks "
                    f"{covered} only, a part of the ranks {root_ranks} of its root "
                    f"{root.name}: rank(s) {missing} hold another copy of it, never averaged "
                    "with this one, which a checkpoint cannot tell apart. Make it expert "
                    "parallel (a DTensor Shard(0) on the mesh dimension beside the unit's, "
                    "e.g. distribute_tensor(w, world_mesh['ep'], [Shard(0)]), before "
                    "fully_shard), or shard it over a 2-D (replicate, shard) mesh so the "
                    "copies are replicas.")
