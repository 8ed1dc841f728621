"""Clipping by the global gradient norm of a sharded model.

``torch.nn.utils.clip_grad_norm_`` works on fullshard's DTensor gradients when they
all live on one mesh. With tensor parallelism, parameters outside the TP plan (norms,
the head) are sharded on the data-parallel mesh and the others on the joint (dp, tp)
mesh, and torch's version then fails to stack norms from different meshes.
:func:`clip_grad_norm_` handles any mix, and is what ``FSDP.clip_grad_norm_`` runs.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .core.mesh import mesh_device


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so their norm over all ranks is at most ``max_norm``;
    return that norm (before clipping) as a float32 tensor on the compute device.

    Each rank sums ``|g|^p`` over its local pieces; gradients are grouped by the mesh
    dimensions they are sharded over, and each group's sum is all-reduced over exactly
    those dimensions (a replicated dimension holds the same values on every rank, so it
    is counted once). Plain gradients (ignored parameters) are counted once, as every
    rank has them.
    """
    max_norm, p = float(max_norm), float(norm_type)
    if p <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or inf), got {norm_type}.")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [t.grad for t in parameters if t.grad is not None]
    sharded: dict[tuple, list[torch.Tensor]] = {}
    local: list[torch.Tensor] = []
    device = torch.device("cpu")
    for g in grads:
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            groups = tuple(mesh.get_group(d) for d, pl in enumerate(g.placements)
                           if isinstance(pl, (Shard, _StridedShard)))
            sharded.setdefault(groups, []).append(g.to_local())
            device = mesh_device(mesh)  # where the all-reduce runs (CPU shards under offload)
        else:
            local.append(g)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, tensors in sharded.items():
        part = _combine(_parts_on(tensors, p, device), p, device)
        for group in groups:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM,
                            group=group)
        total = _combine([total, part], p, device)
    total = _combine([total] + _parts_on(local, p, device), p, device)
    norm = total if math.isinf(p) else total ** (1.0 / p)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    coefs: dict[tuple, torch.Tensor] = {}  # one copy per device and dtype, not per gradient
    with torch.no_grad():
        for g in grads:
            target = g.to_local() if isinstance(g, DTensor) else g
            key = (target.device, target.dtype)
            if key not in coefs:
                coefs[key] = coef.to(target.device, target.dtype)
            target.mul_(coefs[key])
    return norm


def _parts_on(tensors: list[torch.Tensor], p: float, device: torch.device) -> list[torch.Tensor]:
    """The norm parts of ``tensors``, combined where they live (offloaded gradients: on
    the host) and moved to ``device`` once per device rather than once per tensor."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(_norm_part(t, p))
    return [_combine(parts, p, where).to(device) for where, parts in by_device.items()]


def _norm_part(t: torch.Tensor, p: float) -> torch.Tensor:
    """``max |t|`` for the inf-norm, else ``sum |t|^p``, as a float32 scalar."""
    t = t.detach().float()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    if math.isinf(p):
        return t.abs().max()
    return torch.linalg.vector_norm(t, p) ** p


def _combine(parts: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    parts = [x.to(device) for x in parts]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    stacked = torch.stack(parts)
    return stacked.max() if math.isinf(p) else stacked.sum()
