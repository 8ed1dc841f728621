"""One backward's bookkeeping (``BackwardState``, core/state.py): what it expects to
reduce, and what a dropped forward leaves behind."""

import pytest
import torch

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
    after = (backward.running, len(backward.reduced), len(backward.ran_with_grad))
    with torch.no_grad():
        model(x)
    return during, after, [backward.expects_gradients(u) for u in units]


def test_a_backward_runs_from_the_first_gradient_to_the_final_callback_and_then_forgets():
    during, after, after_eval = run_distributed(_backward_state_worker, 2)[0]
    assert during == {"running": True, "expects": [True] * CFG.n_layers, "reduced": 0}
    assert after == (False, 0, 0)  # BackwardState.end() in the final callback
    assert after_eval == [False] * CFG.n_layers  # a forward without grad expects nothing
