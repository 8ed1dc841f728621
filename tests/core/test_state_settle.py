"""How a root's gradients settle (``RootState.settle_gradients``, core/state.py): every
rank settles its roots in the order they were made, and the guard compares before the
copies to the host are waited for."""

import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.core import state
from fullshard.core.state import unit_of
from fullshard.gpt import lm_loss
from fullshard.testing import run_distributed
from support.small_gpt import rank_batch, sharded_gpt


def _settle_order():
    models = []
    for i in range(12):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fully_shard(model[0])
        fully_shard(model)
        model(torch.ones(1, 4)).sum().backward()  # lazy init: roots made in this order
        models.append(model)
    settled = []
    real = state.RootState.settle_gradients

    def spy(root):
        settled.append(next(i for i, m in enumerate(models) if unit_of(m).root is root))
        return real(root)

    state.RootState.settle_gradients = spy
    try:
        state.finish_all_pending_reduces()
    finally:
        state.RootState.settle_gradients = real
    return settled


def test_roots_settle_in_the_order_they_were_made():
    """Settling may issue collectives (a replica all-reduce, the guard's comparison), so
    every rank settles in one order: the roots' order of making, never their addresses."""
    for settled in run_distributed(_settle_order, 2):
        assert settled == list(range(12)), settled


class _CopiesInFlight:
    """Copies to the host still to land (CPU offload on a GPU): settle() would wait."""

    def __init__(self, log):
        self.log = log
        self.in_flight = True

    def settle(self):
        self.log.append("copies settled")


def _compare_before_copies():
    model = sharded_gpt()
    x, y = rank_batch()
    lm_loss(model(x), y).backward()
    root = unit_of(model).root
    log = []
    guard = root.guard
    real_compare = guard.compare
    guard.compare = lambda phase, at_once=False: (
        log.append(f"compared, at once: {at_once}"), real_compare(phase, at_once))[1]
    root.copies = _CopiesInFlight(log)
    lm_loss(model(x), y).backward()
    return log


def test_the_guard_compares_before_waiting_for_copies_to_the_host():
    """A diverged rank's copies wait behind an unmatched collective on the device: waited
    first, they would keep it from ever reaching the comparison (Note [a comparison one
    step behind]); with copies in flight the comparison is finished at once."""
    for log in run_distributed(_compare_before_copies, 2):
        # (the forward settles first too, with no backward to compare)
        assert log == ["copies settled", "compared, at once: True", "copies settled"], log
