"""Whether the units under one root can run together on their meshes.

Units of one model may use different meshes: experts on an expert-data-parallel mesh
(``world_mesh['efsdp']``) beside dense layers on the whole data-parallel mesh, their
weights expert-parallel (DTensors ``Shard(0)`` on ``world_mesh['ep']``). Two layouts
cannot work, and are refused at the first forward, on every rank alike (the meshes are
slices of one mesh, so every rank finds the same mismatch):

* a unit whose mesh reaches ranks outside its root's: those ranks run another model's
  collectives (or none) when this unit gathers;
* a parameter whose shards cover only part of the root's ranks (a plain parameter on a
  sub-mesh): the ranks outside hold another copy whose gradients are never averaged with
  these, and a checkpoint could not tell the copies apart (they share one name).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh


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
