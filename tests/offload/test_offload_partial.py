"""Partial CPU offload: the offload policy is per ``fully_shard`` call, so giving it to
some units only keeps the others' shards, gradients and optimizer states on the
device. Units with and without offload under one root must train as one process does."""

import pytest
import torch
import torch.distributed as dist

from fullshard import CPUOffloadPolicy, fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from fullshard.testing.parity import check_parity

CFG = GPTConfig(vocab_size=40, seq_len=10, d_model=16, n_layers=4, n_heads=2)


def _batch(step, n=12):
    return token_batch(step, n, CFG.vocab_size, CFG.seq_len)


def _shard_some(model, offloaded, merge):
    """Offload the blocks whose index is in ``offloaded``; the root keeps its own."""
    policy = CPUOffloadPolicy(pin_memory=False)
    for i, layer in enumerate(model.layers):
        fully_shard(layer, offload_policy=policy if i in offloaded else None)
    fully_shard(model)
    if not merge:
        model.set_bucket_numel(0)


def _parity(offloaded, optimizer, merge):
    # The key projection's bias has an exactly-zero gradient (softmax ignores a shift),
    # so what reaches AdamW there is rounding noise it scales up to ~lr per step, with no
    # unit offloaded too: a small lr and 1e-5 for AdamW keep that below the tolerance.
    lr, atol = (1e-3, 1e-5) if optimizer == "adamw" else (1e-2, 1e-6)
    report = check_parity(lambda: GPT(CFG), lambda model: _shard_some(model, offloaded, merge),
                          _batch, lambda model, b: lm_loss(model(b[0]), b[1]), steps=4,
                          optimizer=optimizer, lr=lr, atol=atol)
    return report.max_weight_diff


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("offloaded", [{0, 1}, {1, 3}])
def test_partial_offload_parity(world, offloaded):
    run_distributed(_parity, world, offloaded, "adamw", True)


def test_partial_offload_parity_unmerged_sgd():
    run_distributed(_parity, 2, {0, 2}, "sgd", False)


def _where_things_live():
    model = GPT(CFG)
    _shard_some(model, {0}, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(dist.get_rank(), 2)
    lm_loss(model(x), y).backward()
    opt.step()
    return {"offloaded": model.layers[0]._unit.group.offload is not None,
            "kept": model.layers[1]._unit.group.offload is None,
            "root_kept": model._unit.group.offload is None}


def test_partial_offload_policy_per_unit():
    for checks in run_distributed(_where_things_live, 2):
        assert all(checks.values()), checks
