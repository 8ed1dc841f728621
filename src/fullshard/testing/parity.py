"""Parity against a single-process reference: the backbone of fullshard's tests.

Run inside ``run_distributed``. Every rank builds the same model, keeps a deepcopy
as the reference, shards the other copy, and trains both: the sharded model on its
slice of each global batch, the reference on the whole (concatenated) batch. The
mean of the ranks' losses must equal the reference loss at every step, and the
gathered weights must equal the reference weights at the end.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

Batch = Sequence[torch.Tensor]


@dataclass
class ParityReport:
    losses: list[tuple[float, float]] = field(default_factory=list)  # (sharded, reference)
    max_weight_diff: float = 0.0


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    if isinstance(getattr(torch.optim, kind, None), type):  # another torch optimizer by name
        return getattr(torch.optim, kind)(params, lr=lr)
    raise ValueError(f"unknown optimizer {kind!r}")


def local_slice(batch: Batch, rank: int, world_size: int) -> list[torch.Tensor]:
    out = []
    for t in batch:
        n = t.shape[0] // world_size
        out.append(t[rank * n:(rank + 1) * n])
    return out


def check_parity(build: Callable[[], nn.Module], shard: Callable[[nn.Module], None],
                 make_batch: Callable[[int], Batch],
                 loss_fn: Callable[[nn.Module, Batch], torch.Tensor], *, steps: int = 5,
                 optimizer: str = "sgd", lr: float = 0.05, rtol: float = 1e-5,
                 atol: float = 1e-6, micro_batches: int = 1) -> ParityReport:
    """Train sharded and reference models side by side and assert they agree.

    With ``micro_batches > 1`` each optimizer step accumulates that many backward
    passes into ``.grad`` (batches ``make_batch(step * micro_batches + i)``) in both.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = build()
    reference = copy.deepcopy(model)
    shard(model)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    ref_opt = make_optimizer(optimizer, reference.parameters(), lr)
    report = ParityReport()
    for step in range(steps):
        for micro in range(micro_batches):
            batch = make_batch(step * micro_batches + micro)
            loss = loss_fn(model, local_slice(batch, rank, world))
            loss.backward()
            ref_loss = loss_fn(reference, batch)
            ref_loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss /= world
            report.losses.append((mean_loss.item(), ref_loss.item()))
            torch.testing.assert_close(
                mean_loss, ref_loss.detach(), rtol=rtol, atol=atol,
                msg=lambda m: f"loss differs at step {step} micro-batch {micro}: {m}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    report.max_weight_diff = assert_same_weights(model, reference, rtol=rtol, atol=atol)
    return report


def cast_reference_step(master: nn.Module, optimizer: torch.optim.Optimizer,
                        loss_fn: Callable[[nn.Module], torch.Tensor],
                        dtype: torch.dtype) -> torch.Tensor:
    """One step of a single-process mixed-precision reference: a ``dtype`` copy of the fp32
    ``master`` runs forward and backward; its gradients, cast to fp32, step ``optimizer``
    on the master weights (what sharding with ``param_dtype=dtype`` and an fp32
    ``reduce_dtype`` does). Returns the copy's loss."""
    low = copy.deepcopy(master).to(dtype)
    loss = loss_fn(low)
    loss.backward()
    for p, q in zip(master.parameters(), low.parameters()):
        p.grad = q.grad.float()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def full_value(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (sharded) parameter, on the device its mesh computes on."""
    if not hasattr(p, "full_tensor"):
        return p
    mesh = p.device_mesh
    if p.to_local().device.type != mesh.device_type:  # offloaded: NCCL gathers GPU tensors
        from torch.distributed.tensor import DTensor

        device = torch.device("cuda", torch.cuda.current_device()) \
            if mesh.device_type == "cuda" else torch.device(mesh.device_type)
        local = p.to_local().to(device)
        p = DTensor.from_local(local, mesh, p.placements, shape=p.shape, stride=p.stride())
    return p.full_tensor()


def assert_same_weights(model: nn.Module, reference: nn.Module, *, rtol: float,
                        atol: float) -> float:
    """Compare every parameter by name; return the largest absolute difference."""
    sharded = dict(model.named_parameters())
    ref = dict(reference.named_parameters())
    assert sharded.keys() == ref.keys(), f"names differ: {sharded.keys() ^ ref.keys()}"
    worst = 0.0
    for name, p in sharded.items():
        full = full_value(p.detach())
        torch.testing.assert_close(full, ref[name].detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"parameter {n} differs: {m}")
        worst = max(worst, (full - ref[name].detach()).abs().max().item())
    return worst
