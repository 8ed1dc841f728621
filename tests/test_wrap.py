"""Wrap policies (torch.distributed.fsdp.wrap semantics) and auto_wrap."""

import functools

import pytest
import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.parity import check_parity
from fullshard.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig, lm_loss
from fullshard.wrap import (ModuleWrapPolicy, apply_wrap_policy, auto_wrap,
                            lambda_auto_wrap_policy, repeated_block_classes,
                            size_based_auto_wrap_policy, transformer_auto_wrap_policy)

CFG = GPTConfig(vocab_size=48, seq_len=12, d_model=24, n_layers=3, n_heads=4)


def _selected(policy):
    model = GPT(CFG)
    names = {m: n for n, m in model.named_modules()}
    picked = []
    apply_wrap_policy(model, policy, lambda m: picked.append(names[m]))
    return picked


def test_transformer_policy_partial_and_direct_forms():
    expected = ["layers.0", "layers.1", "layers.2", ""]
    assert _selected(functools.partial(transformer_auto_wrap_policy,
                                       transformer_layer_cls={Block})) == expected
    assert _selected(transformer_auto_wrap_policy(transformer_layer_cls={Block})) == expected
    assert _selected(ModuleWrapPolicy({Block})) == expected


def test_size_based_and_lambda_policies():
    per_mlp = sum(p.numel() for p in MLP(CFG).parameters())
    picked = _selected(functools.partial(size_based_auto_wrap_policy, min_num_params=per_mlp))
    # each MLP reaches the threshold; what a block has left once its MLP is wrapped
    # (attention and norms) does not, so blocks are not wrapped; the root always is
    assert picked == ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp", ""]
    lam = lambda_auto_wrap_policy(lambda_fn=lambda m: isinstance(m, CausalSelfAttention))
    assert _selected(lam) == ["layers.0.attn", "layers.1.attn", "layers.2.attn", ""]


def test_repeated_blocks_found():
    assert repeated_block_classes(GPT(CFG)) == {Block}

    class HF(nn.Module):
        _no_split_modules = ["MLP"]

        def __init__(self):
            super().__init__()
            self.a, self.b = MLP(CFG), MLP(CFG)
    assert repeated_block_classes(HF()) == {MLP}
    with pytest.raises(ValueError, match="auto_wrap: found no repeated blocks in Linear"):
        auto_wrap(nn.Linear(2, 2))


def _gpt_batch(step, n):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def _auto_wrap_parity(kind):
    if kind == "auto":
        shard = auto_wrap
    else:
        def shard(model):
            apply_wrap_policy(model, transformer_auto_wrap_policy(transformer_layer_cls={Block}),
                              fully_shard)
    report = check_parity(lambda: GPT(CFG), shard, lambda s: _gpt_batch(s, 4),
                          lambda m, b: lm_loss(m(b[0]), b[1]), optimizer="sgd", steps=4)
    return report.losses


@pytest.mark.parametrize("kind", ["auto", "policy"])
@pytest.mark.slow
def test_auto_wrap_and_policy_parity(kind):
    run_distributed(_auto_wrap_parity, 2, kind)


@pytest.mark.parametrize("threshold", [500, 2000, 5000, 20000])
def test_size_based_policy_decides_as_torchs(threshold):
    from torch.distributed.fsdp import wrap as torch_wrap

    ours = _selected(functools.partial(size_based_auto_wrap_policy, min_num_params=threshold))
    theirs = _selected(functools.partial(torch_wrap.size_based_auto_wrap_policy,
                                         min_num_params=threshold))
    assert ours == theirs
