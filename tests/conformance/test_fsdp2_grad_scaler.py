"""``torch.amp.GradScaler`` on sharded gradients, as torch's FSDP2 tests check it
(test_fully_shard_grad_scaler.py), in our own words:

- ``unscale_`` divides every sharded gradient by the scale; an inf in one rank's shard
  is found on every rank (``found_inf`` is 1 everywhere), ``step`` then leaves the
  parameters and optimizer state as they were and ``update`` backs the scale off; with
  no inf the step runs and the scale stays;
- the same on a 2-D (dp, tp) mesh, the MLPs tensor-parallel within ``tp`` and sharded
  over ``dp``;
- a few scaled steps, one with an inf injected on one rank, train as a single-process
  copy under its own GradScaler, the scales equal at every step (weights to fp32
  rounding: the copy sums all rows at once).

torch runs these on CUDA; the scaler here is the CPU one. One launch of four ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.amp.grad_scaler import GradScaler, OptState
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from support.steps_beside import rank_rows
from fullshard import fully_shard
from fullshard.testing import run_distributed


class _MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _one_d() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    for layer in model:
        fully_shard(layer)
    return fully_shard(model), torch.randn(4, 4)


def _two_d() -> tuple[nn.Module, torch.Tensor]:
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(*[_MLP(2) for _ in range(3)])
    plan = {f"{i}.{name}": style for i in range(3)
            for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}
    model = parallelize_module(model, device_mesh=mesh["tp"], parallelize_plan=plan)
    for mlp in model:
        fully_shard(mlp, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"]), torch.randn(2)


def _unscale_and_step(two_d: bool, has_inf: bool) -> None:
    torch.manual_seed(0)
    model, x = _two_d() if two_d else _one_d()
    scaler = GradScaler("cpu", init_scale=2.0)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler.scale(model(x).sum()).backward()
    first = optim.param_groups[0]["params"][0]
    if has_inf and dist.get_rank() == 1:
        first.grad.to_local()[0, 0] = float("inf")
    scaled = first.grad.to_local().clone()
    scaler.unscale_(optim)
    found = scaler._per_optimizer_states[id(optim)]["found_inf_per_device"]
    assert [f.item() for f in found.values()] == [float(has_inf)] * len(found), found
    assert scaler._per_optimizer_states[id(optim)]["stage"] is OptState.UNSCALED
    torch.testing.assert_close(first.grad.to_local(), scaled * 0.5, rtol=0, atol=0)
    before = [p.to_local().clone() for p in model.parameters()]
    scaler.step(optim)
    after = [p.to_local() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) is has_inf
    assert (len(optim.state) == 0) is has_inf  # a skipped step builds no Adam state
    scaler.update()
    assert scaler.get_scale() == (2.0 * scaler.get_backoff_factor() if has_inf else 2.0)


def _scaled_training() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_MLP(8) for _ in range(2)])
    master = copy.deepcopy(model)
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = rank_rows(world, 2, 8)  # every rank's rows, this rank's first
    everyone = torch.cat([rows[0]] + [torch.empty_like(rows[0]) for _ in range(world - 1)])
    dist.all_gather_into_tensor(everyone, rows[0].contiguous())
    pairs = [(model, rows[0], torch.optim.Adam(model.parameters(), lr=1e-2)),
             (master, everyone, torch.optim.Adam(master.parameters(), lr=1e-2))]
    scalers = [GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) for _ in pairs]
    for step in range(5):
        losses = []
        for (m, x, optim), scaler in zip(pairs, scalers):
            # the reference's loss is the mean of the ranks' sums, as the shards' gradients are
            loss = m(x).sum() / (1 if m is model else world)
            scaler.scale(loss).backward()
            if step == 2:  # an inf on one rank alone skips the step everywhere
                grad = next(m.parameters()).grad
                if m is master or rank == world - 1:
                    (grad.to_local() if m is model else grad)[0, 0] = float("inf")
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
            losses.append(loss.detach())
        assert scalers[0].get_scale() == scalers[1].get_scale(), step
        for p, ref in zip(model.parameters(), master.parameters()):
            torch.testing.assert_close(p.full_tensor(), ref, rtol=1e-6, atol=1e-7)


def _all_cases() -> None:
    for two_d in (False, True):
        for has_inf in (True, False):
            _unscale_and_step(two_d, has_inf)
    _scaled_training()


@pytest.mark.slow
def test_grad_scaler_unscales_skips_and_backs_off_on_sharded_gradients():
    run_distributed(_all_cases, 4)
