"""One backward's bookkeeping (``BackwardState``, core/state.py): what it expects to
reduce, what a dropped forward leaves behind, and a graph backpropagated more than once."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fullshard import fully_shard
from fullshard.core.state import unit_of
from fullshard.gpt import lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_collectives
from support.small_gpt import CFG, rank_batch, sharded_gpt


def _abandoned_forward_worker():
    """A forward with grad whose output is dropped, then a normal step: the dropped
    graph's watches stop counting, so each block still reduces at its module boundary
    during backward (one reduction each, none left for the final callback); then two
    forwards and one backward through both: each block reduces once, both calls in."""
    from fullshard.core import hooks
    model = sharded_gpt(raf=True)
    x, y = rank_batch()
    model(x)  # dropped at once: its graph is freed
    in_place = []
    real = hooks._post_backward

    def post_backward(root, group):
        in_place.append(root.backward.running and not _in_final_callback[0])
        return real(root, group)

    _in_final_callback = [False]
    real_final = hooks._final_callback

    def final(root):
        _in_final_callback[0] = True
        try:
            return real_final(root)
        finally:
            _in_final_callback[0] = False

    hooks._post_backward, hooks._final_callback = post_backward, final
    try:
        lm_loss(model(x), y).backward()
        first = list(in_place)
        in_place.clear()
        with count_collectives() as counts:
            (lm_loss(model(x), y) + lm_loss(model(rank_batch(1)[0]), y)).backward()
    finally:
        hooks._post_backward, hooks._final_callback = real, real_final
    return first, in_place, dict(counts)


@pytest.mark.slow
def test_a_dropped_forward_does_not_hold_back_reductions():
    first, two_forwards, counts = run_distributed(_abandoned_forward_worker, 2)[0]
    # the three blocks at their boundary, the root (token ids) in the final callback
    assert first == [True, True, True, False], first
    assert two_forwards == [True, True, True, False], two_forwards
    assert counts["reduce_scatter"] == CFG.n_layers + 1, counts


def _backward_state_worker():
    model = sharded_gpt()
    x, y = rank_batch()
    logits = model(x)
    backward = unit_of(model).root.backward
    units = [unit_of(layer) for layer in model.layers]
    during = {}
    logits.register_hook(lambda grad: during.update(
        running=backward.running, expects=[backward.expects_gradients(u) for u in units],
        reduced=len(backward.reduced)))
    lm_loss(logits, y).backward()
    after = (backward.running, len(backward.reduced), backward.backpropagated,
             all(backward.expects_gradients(u) for u in units))
    with torch.no_grad():
        model(x)
    after_eval = [backward.expects_gradients(u) for u in units]
    model(x)  # a forward with grad: another graph
    after_new_graph = (backward.backpropagated, all(u in backward.ran_with_grad for u in units))
    return during, after, after_eval, after_new_graph


def test_a_backward_runs_from_the_first_gradient_to_the_final_callback_and_then_forgets():
    during, after, after_eval, after_new_graph = run_distributed(_backward_state_worker, 2)[0]
    assert during == {"running": True, "expects": [True] * CFG.n_layers, "reduced": 0}
    # BackwardState.end() in the final callback: what it reduced is forgotten; the graph's
    # units stay expected (retain_graph may backpropagate it again) ...
    assert after == (False, 0, True, True)
    assert after_eval == [True] * CFG.n_layers  # ... a forward without grad builds none
    assert after_new_graph == (False, True)  # ... until a forward with grad builds another


class _Block(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.checkpointed = checkpointed

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=False)
        return torch.tanh(self.lin(x))


class _Net(nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([_Block(checkpointed) for _ in range(3)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h), h


def _backward_twice(model, x, scale, how):
    """Two (or three) backward passes through one forward's graph, kept by retain_graph."""
    out, hidden = model(x)
    loss, other = out.square().mean() * scale, hidden.sum() * 0.01 * scale
    if how == "twice":
        loss.backward(retain_graph=True)
        loss.backward()
    elif how == "then_another_loss":  # the second backward does not reach the head
        loss.backward(retain_graph=True)
        other.backward()
    else:  # "three_times"
        loss.backward(retain_graph=True)
        other.backward(retain_graph=True)
        loss.backward()


def _retained_graph_worker(how, checkpointed, bucket_numel):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = _Net(checkpointed)
    torch.manual_seed(0)
    model = _Net(checkpointed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.set_bucket_numel(bucket_numel)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    worst = 0.0
    for step in range(3):
        xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + r))
              for r in range(world)]
        _backward_twice(model, xs[rank], 1.0, how)
        for x in xs:
            _backward_twice(reference, x, 1 / world, how)
        worst = max(worst, *((p.grad.full_tensor() - q.grad).abs().max().item()
                             for p, q in zip(model.parameters(), reference.parameters())))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return worst


def _retained_graph_cases():
    return {f"{how}{'_checkpointed' if checkpointed else ''}{'_merged' if bucket else ''}":
            _retained_graph_worker(how, checkpointed, bucket)
            for how, checkpointed, bucket in [
                ("twice", False, 0), ("then_another_loss", False, 0),
                ("three_times", False, 1 << 20), ("twice", True, 0)]}


def test_a_graph_backpropagated_again_reduces_its_gradients_as_one_process():
    """Note [when a unit's backward is done]: the second backward through a retained graph
    fires no watch; its units are still expected, and reduced in its final callback
    (its gradients used to stay on the unsharded parameters into the next step). Twice,
    then another loss that does not reach the head, three times with merged units, and
    twice through non-reentrant checkpointing, in one pair of processes."""
    for case, worst in run_distributed(_retained_graph_cases, 2)[0].items():
        assert worst < 1e-6, case
