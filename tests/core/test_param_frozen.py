"""Frozen and ignored parameters: LoRA-style adapters over frozen base weights."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.parity import check_parity


class LoRALinear(nn.Module):
    """A frozen base weight plus a trainable low-rank update, in one unit."""

    def __init__(self, d_in, d_out, rank=2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class Adapted(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(LoRALinear(8, 16), nn.Tanh(), LoRALinear(16, 4))
        # left out of sharding (ignored_params): not reduced either, so kept frozen here
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4), requires_grad=False)

    def forward(self, x):
        return self.layers(x) * self.scale


def _batch(step, n):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def _shard(model, bucket_numel):
    for block in (model.layers[0], model.layers[2]):
        fully_shard(block)
    fully_shard(model, ignored_params={model.scale})
    model.set_bucket_numel(bucket_numel)


def _lora_parity(bucket_numel):
    model_holder = {}

    def shard(model):
        _shard(model, bucket_numel)
        model_holder["model"] = model

    report = check_parity(Adapted, shard, lambda s: _batch(s, 8),
                          lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
                          optimizer="adamw", steps=5)
    model = model_holder["model"]
    assert not isinstance(model.scale, DTensor)  # ignored: not sharded
    frozen = [model.layers[0].base.weight, model.layers[0].base.bias]
    assert all(isinstance(p, DTensor) and p.grad is None for p in frozen)
    # gradients exist only for the adapters: the gradient buffer holds their shards
    x, y = _batch(0, 2)
    nn.functional.mse_loss(model(x), y).backward()
    group = model.layers[0]._fullshard_unit.group
    trained = [p for p in group.params if p.sharded_param.requires_grad]
    trained_names = {p.fqn for p in trained}
    assert {"layers.0.down.weight", "layers.0.up.weight"} <= trained_names
    assert all(n.endswith(("down.weight", "up.weight")) for n in trained_names)
    assert all(p.grad is None for p in frozen)
    assert all(p.unsharded_param.grad is None for p in group.params)  # freed after reduce
    return report.losses


@pytest.mark.parametrize("bucket_numel", [0, 1 << 20], ids=["per_unit", "merged"])
def test_lora_adapters_over_frozen_weights_and_ignored_params(bucket_numel):
    run_distributed(_lora_parity, 2, bucket_numel)
