"""Small units gathered together (core/batch.py): each unit keeps its group and its flat
shard for life, and one batch gathers and reduces them."""

import pytest
import torch

from fullshard.core.batch import GatherBatch
from fullshard.core.group import GroupState
from fullshard.core.state import unit_of
from fullshard.gpt import lm_loss
from fullshard.testing import run_distributed
from support.small_gpt import rank_batch, same_steps, sgd_steps, sharded_gpt


def _units(model):
    return [unit_of(m) for m in (model, *model.layers)]


def _held_across_lazy_init(raf, world_size_one_rank_mesh=False):
    """An optimizer built and every storage captured before the first forward; what the
    first steps left of them."""
    model = sharded_gpt(raf=raf, bucket_numel=1 << 20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = [p for group in opt.param_groups for p in group["params"]]
    ptrs = [p.to_local().data_ptr() for p in held]
    groups = [u.group for u in _units(model)]
    before = [p.to_local().clone() for p in held]
    for step in range(2):
        x, y = rank_batch(step)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    units = _units(model)
    batch = units[0].batch
    return {
        "same_params": all(a is b for a, b in zip(held, model.parameters())),
        "same_storages": [p.to_local().data_ptr() for p in model.parameters()] == ptrs,
        "same_groups": all(u.group is g for u, g in zip(units, groups)),
        "one_batch": isinstance(batch, GatherBatch) and all(u.batch is batch for u in units),
        # what the optimizer stepped is what the next gather reads: every held local
        # tensor moved, and the gathered parameters equal the stepped shards
        "stepped": all(not torch.equal(b, p.to_local()) for b, p in zip(before, held)),
        "gathers_stepped": _gathers_what_was_stepped(model, groups),
    }


def _gathers_what_was_stepped(model, groups) -> bool:
    """A group held since before the first forward gathers through its batch (user code
    calling it), and its gathered parameters are the full stepped values."""
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    group = groups[1]
    group.unshard()
    gathered = group.state is GroupState.UNSHARDED and group.batch.state is GroupState.UNSHARDED
    ok = gathered and all(torch.equal(dict(model.named_parameters())[n], full[n])
                          for n in full if n.startswith("layers.0."))
    group.reshard()
    return ok and group.state is GroupState.SHARDED


@pytest.mark.parametrize("raf", [True, False])
def test_an_optimizer_built_before_the_first_forward_keeps_its_storages(raf):
    """Batching at the first forward re-points nothing: the optimizer's parameters, their
    local storages and each unit's group are those ``fully_shard`` made, and still what
    the gathers read."""
    for result in run_distributed(_held_across_lazy_init, 2, raf):
        assert result == {"same_params": True, "same_storages": True, "same_groups": True,
                          "one_batch": True, "stepped": True, "gathers_stepped": True}


def _batched_and_alone():
    return (sgd_steps(sharded_gpt(raf=True, bucket_numel=1 << 20), 3),
            sgd_steps(sharded_gpt(raf=True, bucket_numel=0), 3))


@pytest.mark.parametrize("world", [1, 2])
def test_a_batch_trains_to_the_bit_as_units_alone(world):
    """The batch's copy-in and rank-by-rank layout move the same values: losses and
    gradients equal to the bit to those of every unit gathered alone (at one rank the
    batch's parameters are views of each member's own shard)."""
    for batched, alone in run_distributed(_batched_and_alone, world):
        assert same_steps(batched, alone)
