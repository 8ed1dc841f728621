"""Parity with a single-process reference (fp32: rtol 1e-5, atol 1e-6; docs/architecture.md)."""

import copy

import pytest
import torch

from fullshard import fully_shard
from fullshard.testing import run_distributed
from fullshard.testing import models as m
from fullshard.testing.parity import check_parity
from fullshard.gpt import GPT, GPTConfig, lm_loss

GPT_CFG = GPTConfig(vocab_size=48, seq_len=12, d_model=24, n_layers=3, n_heads=4)


def _gpt_batch(step, n):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, GPT_CFG.vocab_size, (n, GPT_CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _gpt_loss(model, batch):
    x, y = batch
    return lm_loss(model(x), y)


def _units(*paths):
    """A shard function: fully_shard each named submodule (innermost first), then the root."""
    def shard(model, raf):
        for path in paths:
            fully_shard(model.get_submodule(path), reshard_after_forward=raf)
        fully_shard(model, reshard_after_forward=raf)
    return shard


def _layers_then_root(model, raf, root_raf="same"):
    """``root_raf="same"``: the root gets ``raf`` too (an explicit True frees it after
    forward, as torch does); pass None for torch's default, which keeps it."""
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=raf)
    fully_shard(model, reshard_after_forward=raf if root_raf == "same" else root_raf)


# name -> (build, shard(model, raf), make_batch(step, n_global), loss, optimizer)
CASES = {
    "odd_mlp": (m.OddMLP, _units("blocks.0", "blocks.1"),
                lambda s, n: m.float_batch(s, n, 7, 3), m.mse_loss, "adamw"),
    "twice_called": (m.TwiceCalled, _units("shared"),
                     lambda s, n: m.float_batch(s, n, 6, 2), m.mse_loss, "adamw"),
    "unused_and_frozen": (m.WithUnusedAndFrozen, _units("body"),
                          lambda s, n: m.float_batch(s, n, 6, 2), m.mse_loss, "adamw"),
    "row_vector_and_buffer": (m.RowVector, _units("proj"),
                              lambda s, n: m.float_batch(s, n, 5, 3), m.mse_loss, "adamw"),
    "kwargs_dict": (m.KwargsDict, _units("enc"),
                    lambda s, n: m.float_batch(s, n, 5, 3), m.kwargs_dict_loss, "adamw"),
    "root_only": (m.OddMLP, _units(), lambda s, n: m.float_batch(s, n, 7, 3), m.mse_loss,
                  "adamw"),
    "gpt_tied": (lambda: GPT(GPT_CFG), _layers_then_root, _gpt_batch, _gpt_loss, "sgd"),
}


def _parity_worker(case, raf, micro_batches=1, bucket_numel=None):
    import torch.distributed as dist

    build, shard, make_batch, loss, opt = CASES[case]
    n = 2 * dist.get_world_size()

    def shard_and_configure(model):
        shard(model, raf)
        if bucket_numel is not None:
            model.set_bucket_numel(bucket_numel)

    report = check_parity(build, shard_and_configure, lambda s: make_batch(s, n), loss,
                          optimizer=opt, steps=5, micro_batches=micro_batches)
    return report.losses


@pytest.mark.parametrize("raf", [True, False], ids=["zero3", "zero2"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_parity(case, world_size, raf):
    losses = run_distributed(_parity_worker, world_size, case, raf)[0]
    assert len(losses) == 5
    # the models actually train: the loss moves
    assert losses[0][1] != losses[-1][1]


@pytest.mark.parametrize("raf", [True, False], ids=["zero3", "zero2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_one_group_per_unit(case, raf):
    """The same models with small-unit merging off (every unit its own collective)."""
    run_distributed(_parity_worker, 2, case, raf, 1, 0)


@pytest.mark.parametrize("case", ["gpt_tied", "unused_and_frozen"])
def test_gradient_accumulation_into_existing_grad(case):
    """Three backward passes per optimizer step accumulate into the sharded .grad."""
    losses = run_distributed(_parity_worker, 2, case, True, 3)[0]
    assert len(losses) == 15


def _sharded_gpt_and_reference():
    """A sharded GPT, its unsharded twin, and an SGD optimizer for each."""
    torch.manual_seed(1234)
    model = GPT(GPT_CFG)
    reference = copy.deepcopy(model)
    _layers_then_root(model, True, root_raf=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    return model, reference, opt, ref_opt


def _step_all(*optimizers):
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _no_sync_worker(use_context, keep_gathered=False):
    import torch.distributed as dist

    from fullshard.testing.counting import count_collectives
    from fullshard.testing.parity import assert_same_weights, local_slice

    rank, world = dist.get_rank(), dist.get_world_size()
    model, reference, opt, ref_opt = _sharded_gpt_and_reference()
    reduces = []
    for step in range(3):
        for micro in range(3):
            batch = _gpt_batch(step * 3 + micro, 2 * world)
            last = micro == 2
            model.set_reshard_after_backward(not (keep_gathered and micro == 0))
            with count_collectives() as counts:
                if use_context and not last:
                    with model.no_sync():
                        _gpt_loss(model, local_slice(batch, rank, world)).backward()
                else:
                    model.set_requires_gradient_sync(last)
                    _gpt_loss(model, local_slice(batch, rank, world)).backward()
            reduces.append(counts.get("reduce_scatter", 0) if not keep_gathered
                           else counts.get("all_gather", 0) + counts.get("all_gather_async", 0))
            _gpt_loss(reference, batch).backward()
        _step_all(opt, ref_opt)
    assert_same_weights(model, reference, rtol=1e-5, atol=1e-6)
    return reduces


@pytest.mark.parametrize("use_context", [False, True], ids=["setter", "no_sync"])
def test_accumulate_without_sync_reduces_once(use_context):
    """Gradient sync off for two micro-batches: no reduce-scatter until the third, which
    reduces the accumulated unsharded gradients; weights match the reference."""
    reduces = run_distributed(_no_sync_worker, 2, use_context)[0]
    assert reduces[0] == reduces[1] == 0 and reduces[2] > 0
    assert reduces == reduces[:3] * 3


def test_reshard_after_backward_false_skips_the_next_gathers():
    """Kept gathered after micro-batch 0's backward, micro-batch 1 gathers nothing;
    micro-batch 2 (after a backward that resharded) gathers again; weights still match."""
    gathers = run_distributed(_no_sync_worker, 2, True, True)[0]
    assert gathers[1] == 0 and gathers[0] > 0 and gathers[2] > 0, gathers


def _not_last_backward_worker():
    import torch.distributed as dist

    from fullshard.testing.parity import assert_same_weights, local_slice

    rank, world = dist.get_rank(), dist.get_world_size()
    model, reference, opt, ref_opt = _sharded_gpt_and_reference()
    left_in_flight = []
    for step in range(3):
        for micro in range(2):
            batch = _gpt_batch(step * 2 + micro, 2 * world)
            model.set_is_last_backward(False)  # even on the last one: step() completes it
            _gpt_loss(model, local_slice(batch, rank, world)).backward()
            left_in_flight.append(bool(model._unit.root.backward.pending_reduces))
            _gpt_loss(reference, batch).backward()
        _step_all(opt, ref_opt)
    assert_same_weights(model, reference, rtol=1e-5, atol=1e-6)
    return left_in_flight


def test_set_is_last_backward_false_leaves_the_last_reduce_in_flight():
    left = run_distributed(_not_last_backward_worker, 2)[0]
    assert all(left)
