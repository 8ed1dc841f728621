"""What the whole-matrix optimizer tests share: a model of small MLP blocks with uneven
rows at 2, 3 and 4 ranks, sharded one unit per block, trained on every rank's batches."""

from __future__ import annotations

import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.testing.parity import full_value


def mlp_blocks() -> nn.Module:
    torch.manual_seed(0)  # 37 rows: uneven shards at 2, 3 and 4 ranks
    return nn.Sequential(*[nn.Sequential(nn.Linear(24, 37), nn.ReLU(), nn.Linear(37, 24))
                           for _ in range(3)])


def batches(step: int, world: int) -> list[torch.Tensor]:
    """One batch per rank for ``step``, the same on every rank and in one process."""
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(4, 24, generator=gen) for _ in range(world)]


def shard_blocks(model: nn.Module, **kwargs) -> nn.Module:
    for block in model:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def train_steps(model, opts, steps, rank, world, first=0, micro_batches=1, sharded=True):
    """``steps`` optimizer steps from step ``first``: sharded, each rank on its batch;
    else one process on the mean over every rank's batches."""
    for step in range(first, first + steps):
        for micro in range(micro_batches):
            xs = batches(step * micro_batches + micro, world)
            if sharded:
                if micro_batches > 1:
                    model.set_requires_gradient_sync(micro == micro_batches - 1)
                model(xs[rank]).square().mean().backward()
            else:
                (sum(model(x).square().mean() for x in xs) / world).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def max_diff(model, reference) -> float:
    """The largest difference between the sharded model's parameters and one process's."""
    return max((full_value(p.detach()) - q.detach()).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))
