"""Parameters that ``shard_placement_fn`` puts on a mesh of their own.

Note [parameters on meshes of their own]
torch 2.13's ``shard_placement_fn`` may return a ``ShardPlacementResult``: a placement
and a mesh for one parameter, so that one ``fully_shard`` call shards an MoE block's
experts over the expert-FSDP mesh and the rest of the block over the whole
data-parallel mesh (torchtitan's expert-parallel layout). FSDP2 keeps one parameter
group per mesh in the call's state. fullshard gives each other mesh a unit of its own:
the largest submodules whose parameters all go to that mesh are sharded first, with
the call's other arguments and their placements, and the call's own unit takes the
rest. The split-off units are the call's companions: gathering the call's unit (its
forward, its backward, a prefetch or an ``unshard()`` naming it) starts theirs too, and
its setters apply to them, as FSDP2's apply to every group of its state. Parameters,
their DTensors, the state dict and the arithmetic are what FSDP2 produces; the units
differ only in that the split-off submodules are FSDPModules as well. Parameters of
one module (its own, not its submodules') on two meshes have no such split and are
refused (E212).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .core.init import managed_modules
from .core.state import unit_of


class MeshSplit(NamedTuple):
    """A submodule whose parameters all go to ``mesh``, to be sharded before the call."""

    module: nn.Module
    mesh: DeviceMesh
    placements: dict[nn.Parameter, Shard]

    def placement_fn(self) -> Callable[[nn.Parameter], Shard | None]:
        return self.placements.get


def _mesh_of(result) -> DeviceMesh | None:
    """The mesh a ``ShardPlacementResult`` names (None for a plain placement)."""
    info = getattr(result, "mesh_info", None)
    return None if info is None else info.mesh


def _own_params(module: nn.Module, ignored: set) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None and p not in ignored]


def _managed(module: nn.Module, ignored: set) -> list[nn.Parameter]:
    """The parameters a ``fully_shard(module)`` would take (none under sharded units)."""
    return [p for _, sub in managed_modules(module) for p in _own_params(sub, ignored)]


def split_by_mesh(label: str, modules: list[nn.Module], mesh: DeviceMesh | None,
                  shard_placement_fn: Callable | None, ignored: set
                  ) -> tuple[list[MeshSplit], Callable | None]:
    """The submodules to shard first, each on its own mesh, and the placement function
    for the rest of the call (Note [parameters on meshes of their own]). Without
    ``ShardPlacementResult`` on another mesh: nothing to split, the function as given."""
    if not callable(shard_placement_fn):
        return [], shard_placement_fn
    results = {p: shard_placement_fn(p) for m in modules for p in _managed(m, ignored)}
    elsewhere = {p: _mesh_of(r) for p, r in results.items()
                 if _mesh_of(r) is not None and not _same_mesh(_mesh_of(r), mesh)}
    if not elsewhere:
        return [], _unwrapped(results)
    splits: list[MeshSplit] = []
    for m in modules:
        _split(label, m, "", elsewhere, results, ignored, splits, top=True)
    rest = {p: r for p, r in results.items() if p not in elsewhere}
    return splits, _unwrapped(rest)


def _same_mesh(a: DeviceMesh, b: DeviceMesh | None) -> bool:
    if b is None:  # the call's default: every rank, one dimension
        return a.ndim == 1 and a.size() == dist.get_world_size()
    return a is b or a == b


def _unwrapped(results: dict) -> Callable[[nn.Parameter], Shard | None]:
    """A placement function returning each parameter's placement alone."""
    plain = {p: getattr(r, "placement", r) for p, r in results.items()}
    return plain.get


def _split(label: str, module: nn.Module, path: str, elsewhere: dict, results: dict,
           ignored: set, splits: list[MeshSplit], top: bool = False) -> None:
    managed = _managed(module, ignored)
    meshes = {elsewhere.get(p) for p in managed}
    if not top and len(meshes) == 1 and None not in meshes and managed:
        splits.append(MeshSplit(module, meshes.pop(),
                                {p: getattr(results[p], "placement", None) for p in managed}))
        return
    own = _own_params(module, ignored)
    placed = [p for p in own if p in elsewhere]
    if placed:
        name = next(n for n, q in module._parameters.items() if q is placed[0])
        fqn = f"{path}.{name}" if path else name
        where = ("the module being sharded itself" if top else
                 f"{type(module).__name__} '{path}', whose parameters are not all on that mesh")
        raise NotImplementedError(
            f"fully_shard({label}): shard_placement_fn put parameter '{fqn}' on mesh "
            f"{elsewhere[placed[0]]}, but it belongs to {where}; fullshard shards the "
            "parameters of another mesh as a unit of their own, one or more submodules "
            "holding only them. Give them such a submodule, or fully_shard(it, mesh=...) "
            "first and return Shard(dim) or None for them here.")
    for name, child in module._modules.items():
        if child is not None and unit_of(child) is None:
            _split(label, child, f"{path}.{name}" if path else name, elsewhere, results,
                   ignored, splits)
