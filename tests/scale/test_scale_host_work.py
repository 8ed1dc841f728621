"""Nothing per step on the host grows with the world size: the same Python calls, the same
allocations, flat host time (fake process group)."""

import os

import pytest

from fullshard.testing.dispatch_log import DispatchLog
from fullshard.testing.fake_world import fake_world
from fullshard.testing.scale import BlocksRun, host_times, python_calls, trainer, trainer_step

pytestmark = pytest.mark.scale

SMALL, LARGE = 8, 1024
# Host CPU time per step at 1,024 ranks over that at 8, outside the backend's calls (the
# least of 24 steps at each), with the timed steps' collectives moving nothing
# (QuietBackend): the fake backend's 1,024 chunk copies per collective left the caches
# colder for what followed and made 0.99-1.6 of a flat step. The design says flat: 1.10
# (row_blocks: 0.94-1.07 in three runs on a shared 2-core machine).
# FULLSHARD_SCALE_MARGIN sets the bound.
MARGIN = float(os.environ.get("FULLSHARD_SCALE_MARGIN", "1.10"))
# The trainer's workload, the debug GPT, has parameters of fewer rows than 1,024 ranks: a
# rank still holds one row of each, so its all-gathered buffer and its reduce-scatter's
# input hold N rows a parameter (542,720 elements at 1,024 ranks, 28,800 at 8), copied
# in and out on this CPU every step: +0.5 ms of copy_, fill_ and cat at 1,024 in a
# profile, the model's sharding (dim 0, as FSDP2's), not the trainer's host work.
# Measured 1.07-1.50 here (a shared machine adds to the larger copies more than to the
# smaller); FULLSHARD_SCALE_PADDED_MARGIN sets its bound.
PADDED_MARGIN = float(os.environ.get("FULLSHARD_SCALE_PADDED_MARGIN", "1.75"))


def blocks(world):
    return BlocksRun().step


def trainer_steps(world):
    run = trainer(world)
    return lambda: trainer_step(run)


@pytest.mark.parametrize("build", [blocks, trainer_steps])
def test_calls_per_step_do_not_grow_with_the_world(build):
    calls = {}
    for world in (SMALL, LARGE):
        with fake_world(world):
            step = build(world)
            step()  # lazy initialization
            calls[world] = python_calls(step)
    # a loop over ranks would add at least LARGE - SMALL calls; a few differ by branch
    # (a shard's padding), whatever the size
    assert abs(calls[LARGE] - calls[SMALL]) < 16, calls


def step_ops(build, world: int) -> list:
    """Every operation of one step (after the first) at ``world``."""
    with fake_world(world):
        step = build(world)
        step()
        with DispatchLog() as log:
            step()
    return log.ops


def grown_allocations(build, small: int = 64) -> list[tuple[int, int]]:
    """(numel at ``small``, at LARGE) of each tensor a step allocates whose size differs;
    the two steps must dispatch the same operations."""
    a, b = step_ops(build, small), step_ops(build, LARGE)
    assert [op.name for op in a] == [op.name for op in b]
    return [(x, y) for op_a, op_b in zip(a, b) if op_a.allocates
            for x, y in zip(op_a.outputs, op_b.outputs) if x != y]


def test_nothing_fullshard_allocates_per_step_grows_with_the_world():
    # what grows with N (the reduce-scatter's chunks each end in flags and a digest)
    # lives in buffers made once, not per step
    assert grown_allocations(blocks) == []


def test_nothing_the_trainer_allocates_per_step_grows_with_the_world():
    # its statistics are reduced, not gathered (train/step_stats.py): every rank's peak
    # is gathered only on the steps that evaluate or save, which this step is not
    assert grown_allocations(trainer_steps) == []


@pytest.mark.parametrize("build, margin", [(blocks, MARGIN), (trainer_steps, PADDED_MARGIN)])
def test_host_time_per_step_is_flat_from_8_to_1024_ranks(build, margin):
    def measured():
        times = host_times(build, (SMALL, LARGE), rounds=3, steps=8, quiet=True)
        return times[LARGE].own_best / times[SMALL].own_best, times

    ratio, times = measured()
    if ratio > margin:
        # once more before failing: a slow spell of a shared machine gave 1.22 and 1.30
        # (2.4 ms steps) where the runs before and after gave 0.94-1.12; work that grows
        # with the ranks (a loop over them is 128 times the work at 1,024) fails both
        ratio, times = min((ratio, times), measured(), key=lambda pair: pair[0])
    assert ratio <= margin, (ratio, times)
