"""A group's communication settings (core/comm_groups.py): reduce-scatters on a process
group of their own, and several reductions in flight."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fullshard import fully_shard
from fullshard.core import gradients, group as group_module
from fullshard.gpt import lm_loss
from fullshard.testing import run_distributed
from support.rank_failures import failure_report
from support.small_gpt import rank_batch, same_steps, sgd_steps, sharded_gpt


@contextlib.contextmanager
def groups_used():
    """Yield a list that gets (collective, process group) for each of fullshard's
    gathers, reduce-scatters and all-reduces."""
    seen = []
    real_gather, real_reduce = group_module.all_gather, gradients.reduce_scatter_sum
    real_all_reduce = gradients.all_reduce_sum

    def all_gather(out, shard, pg, *args, **kwargs):
        seen.append(("all_gather", pg))
        return real_gather(out, shard, pg, *args, **kwargs)

    def reduce_scatter_sum(out, full, pg, *args, **kwargs):
        seen.append(("reduce_scatter_sum", pg))
        return real_reduce(out, full, pg, *args, **kwargs)

    def all_reduce_sum(tensor, pg, *args, **kwargs):
        seen.append(("all_reduce_sum", pg))
        return real_all_reduce(tensor, pg, *args, **kwargs)

    group_module.all_gather, gradients.reduce_scatter_sum = all_gather, reduce_scatter_sum
    gradients.all_reduce_sum = all_reduce_sum
    try:
        yield seen
    finally:
        group_module.all_gather, gradients.reduce_scatter_sum = real_gather, real_reduce
        gradients.all_reduce_sum = real_all_reduce


def _separate_group_worker():
    plain = sgd_steps(sharded_gpt(), 3)
    model = sharded_gpt()
    model.set_separate_reduce_scatter_group()
    shard_pg = model._unit.group.pg
    with groups_used() as seen:
        separate = sgd_steps(model, 3)
    reduce_pgs = {pg for name, pg in seen if name == "reduce_scatter_sum"}
    gather_pgs = {pg for name, pg in seen if name == "all_gather"}
    own = reduce_pgs.pop() if len(reduce_pgs) == 1 else None
    model.set_separate_reduce_scatter_group(False)
    with groups_used() as seen_after:
        sgd_steps(model, 1)
    return {
        "same_losses_and_gradients": same_steps(plain, separate),
        "one_reduce_group": own is not None and not reduce_pgs,
        "own_group_differs": own is not None and own is not shard_pg
                             and own.group_name != shard_pg.group_name,
        "own_group_same_ranks": own is not None and dist.get_process_group_ranks(own)
                                == dist.get_process_group_ranks(shard_pg),
        "gathers_on_shard_group": gather_pgs == {shard_pg},
        "back_on_shard_group": {pg for name, pg in seen_after
                                if name == "reduce_scatter_sum"} == {shard_pg},
    }


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatters_run_on_one_group_of_their_own_with_the_same_losses(world):
    for result in run_distributed(_separate_group_worker, world, nccl_rules=True):
        assert all(result.values()), result


def _cached_worker():
    model = sharded_gpt()
    model.set_separate_reduce_scatter_group()
    first = {u.group.comm_options.reduce_pg for u in [model._unit, *map(_unit, model.layers)]}
    model.set_separate_reduce_scatter_group()  # again: each keeps the group it has
    again = {u.group.comm_options.reduce_pg for u in [model._unit, *map(_unit, model.layers)]}
    return len(first), first == again


def _unit(module):
    return module._unit


def test_one_group_per_rank_set_kept_across_calls():
    assert run_distributed(_cached_worker, 2) == [(1, True)] * 2


def _hybrid_model(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _hybrid_grads(model):
    g = torch.Generator().manual_seed(dist.get_rank())
    model(torch.randn(4, 8, generator=g)).sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def _hybrid_worker():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    plain = _hybrid_grads(_hybrid_model(mesh))
    model = _hybrid_model(mesh)
    model.set_separate_reduce_scatter_group()
    model.set_reduce_scatter_max_input_buffers(2)
    group = model[0]._unit.group
    with groups_used() as seen:
        grads = _hybrid_grads(model)
    own = group.comm_options.reduce_pg
    return ({pg for name, pg in seen if name == "reduce_scatter_sum"} == {own},
            {pg for name, pg in seen if name == "all_reduce_sum"} == {group.replicate_pg},
            dist.get_process_group_ranks(own) == dist.get_process_group_ranks(group.pg),
            all(map(torch.equal, plain, grads)))


@pytest.mark.slow
def test_hybrid_sharding_all_reduces_across_replicas_on_the_replicate_group():
    """The reduce-scatters on their own group, two in flight: the all-reduces stay on the
    replicate group and the gradients are those of the default settings."""
    assert run_distributed(_hybrid_worker, 4) == [(True, True, True, True)] * 4


def _in_flight_worker(n):
    model = sharded_gpt()  # three layers and the root: four reductions per backward
    model.set_reduce_scatter_max_input_buffers(n)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    most, left, grads = 0, [], []
    for step in range(3):
        x, y = rank_batch(step)
        model.set_is_last_backward(step != 1)  # step 1 leaves its reductions in flight
        loss = lm_loss(model(x), y)
        backward = model._unit.root.backward
        watched = backward.pending_reduces = _Watched(backward.pending_reduces)
        loss.backward()
        most = max(most, watched.most)
        left.append(len(backward.pending_reduces))
        opt.step()  # finishes what is left
        left.append(len(backward.pending_reduces))
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        opt.zero_grad(set_to_none=False)
    return most, left, grads


class _Watched(list):
    """The root's list of reductions in flight, noting the longest it got."""

    def __init__(self, items):
        super().__init__(items)
        self.most = len(self)

    def append(self, item):
        super().append(item)
        self.most = max(self.most, len(self))


def test_up_to_n_reductions_stay_in_flight_with_the_gradients_of_one():
    most_1, left_1, grads_1 = run_distributed(_in_flight_worker, 2, 1)[0]
    most_3, left_3, grads_3 = run_distributed(_in_flight_worker, 2, 3)[0]
    assert (most_1, most_3) == (1, 3)
    # settled after each backward but step 1's, which leaves n in flight for step()
    assert left_1 == [0, 0, 1, 0, 0, 0]
    assert left_3 == [0, 0, 3, 0, 0, 0]
    for step_1, step_3 in zip(grads_1, grads_3):
        for a, b in zip(step_1, step_3):
            assert torch.equal(a, b)


def _ranks_disagree_on_the_group():
    os.environ["FULLSHARD_DEBUG_TIMEOUT"] = "20"
    os.environ["FULLSHARD_DEBUG"] = "1"  # compare before every collective: caught at once
    model = sharded_gpt()
    model.set_separate_reduce_scatter_group()  # made on both ranks (a collective) ...
    if dist.get_rank() == 1:
        model.set_separate_reduce_scatter_group(False)  # ... then left on rank 1
    x, y = rank_batch(0)
    lm_loss(model(x), y).backward()


def test_ranks_that_disagree_on_the_group_are_named_not_hung():
    text = failure_report(_ranks_disagree_on_the_group)
    assert text.count("DivergenceError: fullshard: ranks diverged") == 2, text[-3000:]
    assert "rank 0 ran the reduce-scatter on its own process group of 'layers.2'" in text, \
        text[-3000:]
    assert "rank 1 ran the reduce-scatter of 'layers.2'" in text, text[-3000:]



_BAD_BUFFERS = (0, 2.5, True)


def _setter_refusals() -> list[tuple[str, str]]:
    model = fully_shard(torch.nn.Linear(4, 4))
    refused = []
    for bad in _BAD_BUFFERS:
        try:
            model.set_reduce_scatter_max_input_buffers(bad)
        except (TypeError, ValueError) as err:
            refused.append((type(err).__name__, str(err)))
    return refused


def test_the_setter_and_the_estimate_refuse_reductions_in_flight_with_one_check():
    """set_reduce_scatter_max_input_buffers and estimate(reduces_in_flight=) refuse the
    same values in the same words, each with its exception type (the setter TypeError for
    a value that is no int, as torch's does; the estimate ValueError, as for every bad
    argument it takes)."""
    from fullshard.gpt import GPTConfig
    from fullshard.memory import estimate

    said = "must be an int >= 1 (how many gradient reductions may be in flight), got "
    (by_setter,) = run_distributed(_setter_refusals, 1)
    assert by_setter == [("ValueError", f"max_input_buffers {said}0"),
                         ("TypeError", f"max_input_buffers {said}2.5"),
                         ("TypeError", f"max_input_buffers {said}True")]
    tiny = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    for bad in _BAD_BUFFERS:
        with pytest.raises(ValueError) as by_estimate:
            estimate(tiny, world_size=2, device="cpu", reduces_in_flight=bad)
        assert str(by_estimate.value) == f"estimate: reduces_in_flight {said}{bad!r}"
