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

from .core.comm import note_collective
from .core.features.grad_norms import squared_sum
from .core.mesh import mesh_device


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so their norm over all ranks is at most ``max_norm``;
    return that norm (before clipping) as a float32 tensor on the compute device.

    Each rank sums ``|g|^p`` over its local pieces; gradients are grouped by the mesh
    dimensions they are sharded over, and each group's sum is all-reduced over exactly
    those dimensions (a replicated dimension holds the same values on every rank, so it
    is counted once). Plain gradients (ignored parameters) are counted once, as every
    rank has them. ``max_norm=inf`` only measures: the gradients are left as they are.
    Offloaded gradients whose 2-norms were measured on the device as they were reduced
    are not read for the norm (Note [gradient norms measured before the copy to the
    host]); the clipped ``.grad`` values are the same either way.
    """
    max_norm = float(max_norm)
    grads = _grads_of(parameters)
    norm = _total_norm(grads, norm_type)
    if math.isinf(max_norm):
        # clipping off (the trainer's grad_clip 0): a multiply by 1.0 of every gradient
        # would change nothing a step uses (a non-finite norm skips the step)
        return norm
    coef = clip_coefficient(norm, max_norm)
    with torch.no_grad():
        targets = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        for (where, dtype), tensors in _by_device_and_dtype(targets).items():
            # one kernel per device and dtype, and one copy of the coefficient
            torch._foreach_mul_(tensors, coef.to(where, dtype))
    return norm


def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The gradients' norm over all ranks, as :func:`clip_grad_norm_` measures it, with
    the gradients left as they are (for a caller that applies :func:`clip_coefficient` in
    its optimizer step: Note [the clip applied inside the step])."""
    return _total_norm(_grads_of(parameters), norm_type)


def norm_of_grads(grads: Iterable[torch.Tensor | None], norm_type: float = 2.0
                  ) -> torch.Tensor:
    """The norm over all ranks of ``grads`` (None entries left out), as :func:`grad_norm`
    measures the gradients of parameters; for gradients some of which are no parameter's
    ``.grad`` any more (``OverlappedStep.gradients_of``)."""
    return _total_norm([g for g in grads if g is not None], norm_type)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What :func:`clip_grad_norm_` multiplies the gradients by (at most 1), on the norm's
    device, as torch's ``clip_grad_norm_`` computes it."""
    return torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)


def _grads_of(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [t.grad for t in parameters if t.grad is not None]


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm over all ranks of ``grads`` (see :func:`clip_grad_norm_`)."""
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or inf), got {norm_type}.")
    sharded: dict[tuple, list[torch.Tensor]] = {}  # the groups sharded over -> grads
    groups_of: dict[tuple, tuple] = {}  # (mesh, placements) -> the groups sharded over
    local: list[torch.Tensor] = []
    device = torch.device("cpu")
    for g in grads:
        if isinstance(g, DTensor):
            key = (g.device_mesh, g.placements)
            groups = groups_of.get(key)
            if groups is None:
                mesh = g.device_mesh
                groups = groups_of[key] = tuple(
                    mesh.get_group(d) for d, pl in enumerate(g.placements)
                    if isinstance(pl, (Shard, _StridedShard)))
                device = mesh_device(mesh)  # where the all-reduce runs (CPU shards under offload)
            sharded.setdefault(groups, []).append(g)
        else:
            local.append(g)
    parts = _measured_parts(sharded, local, p, device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, tensors in sharded.items():
        part = parts[groups] if parts is not None else _combine(
            _parts_on([g.to_local() for g in tensors], p, device), p, device)
        for group in groups:
            dist.all_reduce(part, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM,
                            group=group)
            note_collective()  # Note [collectives settle before exit]
        total = _combine([total, part], p, device)
    total = _combine([total] + _parts_on(local, p, device), p, device)
    return total if math.isinf(p) else total ** (1.0 / p)


def _measured_parts(sharded: dict[tuple, list[torch.Tensor]], local: list[torch.Tensor],
                    p: float, device: torch.device) -> dict[tuple, torch.Tensor] | None:
    """Each group's ``sum |g|^2`` from the norms measured on the device, where every
    gradient asked about has one, unchanged (Note [gradient norms measured before the
    copy to the host]); else None, and the gradients are read."""
    if p != 2.0 or local or not sharded:
        return None
    parts = {}
    for groups, tensors in sharded.items():
        if len(_by_device_and_dtype([g.to_local() for g in tensors])) > 1:
            return None  # the host pass would sum per dtype, in another order
        part = squared_sum(tensors)
        if part is None:
            return None
        parts[groups] = part.to(device)
    return parts


def _by_device_and_dtype(tensors: list[torch.Tensor]
                         ) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def _parts_on(tensors: list[torch.Tensor], p: float, device: torch.device) -> list[torch.Tensor]:
    """The norm parts (``max |t|`` for the inf-norm, else ``sum |t|^p``, float32) of
    ``tensors``: one foreach kernel per device and dtype, combined where the tensors live
    (offloaded gradients: on the host) and moved to ``device`` once per device."""
    parts: list[torch.Tensor] = []
    for (where, _), group in _by_device_and_dtype(
            [t.detach() for t in tensors if t.numel() > 0]).items():
        norms = torch.stack(torch._foreach_norm(group, p, dtype=torch.float32))
        parts.append((norms.max() if math.isinf(p) else norms.pow(p).sum()).to(device))
    return parts


def _combine(parts: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    parts = [x.to(device) for x in parts]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    stacked = torch.stack(parts)
    return stacked.max() if math.isinf(p) else stacked.sum()
