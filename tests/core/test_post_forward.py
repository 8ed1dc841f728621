"""reshard_after_forward=N (hpZ, core/post_forward.py): after forward a unit keeps its
parameters gathered within groups of N ranks, and backward re-gathers from those; the
training equals one process's."""

import pytest
import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import models as m
from fullshard.testing import run_distributed
from fullshard.testing.parity import check_parity

CFG = GPTConfig(vocab_size=48, seq_len=12, d_model=24, n_layers=3, n_heads=4)


def _gpt_batch(step, n):
    return m.token_batch(step, n, CFG.vocab_size, CFG.seq_len)


def _hpz_parity(case):
    if case == "gpt":
        build, opt = (lambda: GPT(CFG)), "sgd"
        batch = _gpt_batch
        loss = lambda model, b: lm_loss(model(b[0]), b[1])  # noqa: E731
    else:
        build, opt, loss = m.OddMLP, "adamw", m.mse_loss
        batch = lambda s, n: m.float_batch(s, n, 7, 3)  # noqa: E731

    def shard(model):
        for path in ("layers.0", "layers.1", "layers.2") if case == "gpt" else ("blocks.0",):
            fully_shard(model.get_submodule(path), reshard_after_forward=2)
        fully_shard(model, reshard_after_forward=2)
        model.set_bucket_numel(0)
    return check_parity(build, shard, lambda s: batch(s, 8), loss, optimizer=opt,
                        steps=5).losses


@pytest.mark.parametrize("case", ["gpt", "mlp"])
@pytest.mark.slow
def test_reshard_after_forward_int_parity(case):
    run_distributed(_hpz_parity, 4, case)


def _hpz_collective_sizes():
    from fullshard.core import group as group_module
    from fullshard.core import post_forward as post_forward_module

    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=2)
    fully_shard(model)
    model.set_bucket_numel(0)
    seen = []
    real = group_module.all_gather

    def recording(out, shard, pg, async_op=False, **kwargs):
        seen.append((phase[0], pg.size(), out.numel()))
        return real(out, shard, pg, async_op=async_op, **kwargs)
    phase = ["forward"]
    group_module.all_gather = post_forward_module.all_gather = recording
    try:
        x, y = _gpt_batch(dist.get_rank(), 2)
        loss = lm_loss(model(x), y)
        phase[0] = "backward"
        loss.backward()
    finally:
        group_module.all_gather = post_forward_module.all_gather = real
    return seen


@pytest.mark.slow
def test_reshard_after_forward_int_gathers_within_the_smaller_group():
    """Forward gathers over all 4 ranks; backward re-gathers each layer from 2 ranks."""
    seen = run_distributed(_hpz_collective_sizes, 4)[0]
    forward = [s for s in seen if s[0] == "forward"]
    backward = [s for s in seen if s[0] == "backward"]
    assert forward and all(size == 4 for _, size, _ in forward)
    assert len(backward) == CFG.n_layers and all(size == 2 for _, size, _ in backward)
