"""Small units gathered together (core/batch.py): each unit keeps its group and its flat
shard for life, and one batch gathers and reduces them."""

import copy

import pytest
import torch
import torch.nn as nn

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.core.batch import GatherBatch
from fullshard.core.group import GroupState
from fullshard.core.state import unit_of
from fullshard.gpt import GPT, lm_loss
from fullshard.testing import run_distributed
from support.small_gpt import CFG, rank_batch, same_steps, sgd_steps, sharded_gpt


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


def _gpt(bucket_numel: int, bf16: bool):
    torch.manual_seed(0)
    model = GPT(CFG)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.set_bucket_numel(bucket_numel)
    return model


def _batched_and_alone(bf16: bool):
    batched = _gpt(1 << 20, bf16)
    steps = sgd_steps(batched, 3)
    one_batch = len({unit_of(m).batch for m in (batched, *batched.layers)}) == 1
    return one_batch, steps, sgd_steps(_gpt(0, bf16), 3)


@pytest.mark.parametrize("world,bf16", [(1, False), (2, False), (2, True), (1, True)])
def test_a_batch_trains_to_the_bit_as_units_alone(world, bf16):
    """The batch's copy-in (casting under mixed precision) and rank-by-rank layout move
    the same values: losses and gradients equal to the bit to those of every unit
    gathered alone (at one rank without a cast the batch's parameters are views of each
    member's own shard)."""
    for one_batch, batched, alone in run_distributed(_batched_and_alone, world, bf16):
        assert one_batch
        assert same_steps(batched, alone)


class _CalledAgain(nn.Module):
    """Three small units gathered as one batch, the first called again after the last."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        return self.a(self.c(self.b(self.a(x))))


def _a_member_called_again():
    torch.manual_seed(0)
    model = _CalledAgain()
    reference = copy.deepcopy(model)
    for module in (model.a, model.b, model.c, model):
        fully_shard(module)
    model.set_bucket_numel(1 << 20)
    x = torch.randn(4, 8)
    out = model(x)
    batch = unit_of(model.a).batch
    batched = isinstance(batch, GatherBatch) and all(
        unit_of(m).batch is batch for m in (model.b, model.c))
    resharded = batch.state is GroupState.SHARDED
    out.sum().backward()
    reference(x).sum().backward()
    grads = all(torch.equal(p.grad.full_tensor(), q.grad)
                for p, q in zip(model.parameters(), reference.parameters()))
    return {"batched": batched, "resharded after forward": resharded, "grads": grads}


def test_a_member_run_again_after_the_batch_resharded_reshards_it_again():
    """Once every member of a batch has run forward the batch reshards; a member run again
    gathers it again, and the batch reshards once more after that call (a count of the
    members still to run, which a second call does not lower)."""
    for result in run_distributed(_a_member_called_again, 2):
        assert result == {"batched": True, "resharded after forward": True, "grads": True}
