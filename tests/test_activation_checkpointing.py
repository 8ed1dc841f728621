"""Activation checkpointing with fully_shard: parity, names kept, activations fall."""

import pytest
import torch

from fullshard import apply_activation_checkpointing, fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.parity import check_parity
from fullshard.gpt import GPT, Block, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=48, seq_len=16, d_model=32, n_layers=3, n_heads=4)


def _is_block(m):
    return isinstance(m, Block)


def _batch(step, n):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def _shard(model, order, raf):
    if order == "fsdp1_torch_style":  # the FSDP1 recipe, imports changed
        from functools import partial

        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, checkpoint_wrapper)

        from fullshard import FSDP, ShardingStrategy
        from fullshard.wrap import ModuleWrapPolicy
        FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=(
            ShardingStrategy.FULL_SHARD if raf else ShardingStrategy.SHARD_GRAD_OP))
        wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=_is_block)
        return
    if order == "ac_first":
        apply_activation_checkpointing(model, _is_block)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=raf)
    fully_shard(model, reshard_after_forward=raf)
    if order == "shard_first":
        apply_activation_checkpointing(model, _is_block)


def _parity(order, raf):
    report = check_parity(lambda: GPT(CFG), lambda m: _shard(m, order, raf),
                          lambda s: _batch(s, 4), lambda m, b: lm_loss(m(b[0]), b[1]),
                          optimizer="sgd", steps=4)
    return report.losses


@pytest.mark.parametrize("raf", [True, False], ids=["zero3", "zero2"])
@pytest.mark.parametrize("order", ["ac_first", "shard_first", "fsdp1_torch_style"])
@pytest.mark.slow
def test_checkpointing_composes_with_sharding(order, raf):
    run_distributed(_parity, 2, order, raf)


def _saved_bytes(model):
    saved = {}

    def pack(t):
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t
    x, y = _batch(0, 4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(x), y)
    return sum(saved.values())


def test_activations_fall_and_names_stay():
    plain = GPT(CFG)
    names = [n for n, _ in plain.named_parameters()]
    before = _saved_bytes(plain)
    chosen = apply_activation_checkpointing(plain, _is_block)
    assert len(chosen) == CFG.n_layers
    assert [n for n, _ in plain.named_parameters()] == names
    after = _saved_bytes(plain)
    # each block keeps only its input; the head and embeddings keep theirs
    assert after < 0.5 * before, (before, after)
    with pytest.raises(ValueError, match="Block is already checkpointed"):
        apply_activation_checkpointing(plain.layers[0], _is_block)


def test_other_checkpoint_wrappers_raise():
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper, offload_wrapper)

    model = GPT(CFG)
    with pytest.raises(ValueError, match="reentrant checkpointing is not supported"):
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT))
    with pytest.raises(ValueError, match="other than torch's checkpoint_wrapper"):
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=offload_wrapper)
    chosen = apply_activation_checkpointing(
        model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel: isinstance(module, Block))
    assert len(chosen) == CFG.n_layers
