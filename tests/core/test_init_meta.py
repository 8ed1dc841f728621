"""Meta-device init: build on meta, shard, to_empty, init; no rank holds the full model."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.parity import assert_same_weights
from fullshard.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=50, seq_len=8, d_model=24, n_layers=2, n_heads=2)


def _meta_worker():
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    model.init_weights()
    # every rank holds only its rows: about 1/world of the model
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert local <= total / world + 2 * CFG.d_model * len(list(model.parameters())), (local, total)
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.device.type == "cpu" and not p.to_local().is_meta
    # the init wrote into the shards fullshard gathers from: a reference built from the
    # gathered weights trains identically
    reference = GPT(CFG)
    reference.load_state_dict({n: v.full_tensor() for n, v in model.state_dict().items()})
    assert_same_weights(model, reference, rtol=0, atol=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, CFG.vocab_size, (2 * world, CFG.seq_len), generator=g)
        y = torch.roll(x, -1, 1)
        loss = lm_loss(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_weights(model, reference, rtol=1e-5, atol=1e-6)
    return local


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.slow
def test_meta_init_then_train(world_size):
    locals_ = run_distributed(_meta_worker, world_size)
    assert len(locals_) == world_size
