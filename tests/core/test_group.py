"""ParamGroup's gather and reduce: one all-gather before a unit's forward and one before
its backward when its parameters were freed, one reduce-scatter per unit per step,
prefetched from the second step on (core/group.py, core/gradients.py)."""

import pytest

from fullshard.testing import run_distributed
from support.small_gpt import CFG, count_per_step


@pytest.mark.parametrize("raf", [True, False])
def test_collectives_per_step_one_per_unit(raf):
    units, layers = CFG.n_layers + 1, CFG.n_layers
    steps = run_distributed(count_per_step, 2, raf)[0]
    # first step: no recorded order yet, so forward gathers synchronously
    fwd, bwd = steps[0]
    assert fwd == {"all_gather": units}
    # later steps: the root gathers on demand, every layer is prefetched
    for fwd, bwd in steps[1:]:
        assert fwd == {"all_gather": 1, "all_gather_async": layers}
    for fwd, bwd in steps:
        expected = {"reduce_scatter": units}
        if raf:  # the layers were freed after forward: gathered again, prefetched
            expected["all_gather_async"] = layers
        assert bwd == expected, (raf, bwd)


def test_explicit_reshard_after_forward_on_the_root_is_honoured():
    """torch's semantics: the root keeps its parameters by default (None), but an explicit
    True frees them after forward, so backward gathers the root again."""
    units, layers = CFG.n_layers + 1, CFG.n_layers
    steps = run_distributed(count_per_step, 2, True, 0, True)[0]
    for fwd, bwd in steps[1:]:
        assert fwd == {"all_gather": 1, "all_gather_async": layers}
        assert bwd == {"all_gather": 1, "all_gather_async": layers, "reduce_scatter": units}
