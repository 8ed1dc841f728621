"""The collectives rank 0 issues per step, at world sizes 8 to 1,024 (fake process group):
count, sizes and order as the design says."""

import pytest
import torch.distributed.distributed_c10d as c10d

from fullshard.core.gradients import chunk_tail_numel
from fullshard.testing.dispatch_log import DispatchLog
from fullshard.testing.fake_world import fake_world
from fullshard.testing.scale import WORLD_SIZES, BlocksRun, row_blocks, trainer, trainer_step

pytestmark = pytest.mark.scale


def sizes(op):
    """(numel sent, numel received) by this rank: c10d's all-gather and reduce-scatter
    both take (output, input)."""
    received, sent = op.inputs[:2]
    return sent, received


def step_collectives(run) -> list:
    run.step()  # the first step initializes lazily
    with DispatchLog() as log:
        run.step()
    return log.collectives


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_one_gather_per_unit_each_way_and_one_reduce_scatter_sized_numel_over_n(
        world, monkeypatch):
    with fake_world(world):
        run = BlocksRun()
        run.step()  # lazy initialization may make groups; a step may not
        made = []
        # every way of making a group (new_group, split_group, a mesh's) ends here
        real = c10d._new_group_with_tag
        monkeypatch.setattr(c10d, "_new_group_with_tag",
                            lambda *a, **k: made.append(a) or real(*a, **k))
        ops = step_collectives(run)
    assert made == []
    shards = [sum(p.numel() for p in block.parameters()) // world for block in row_blocks()]
    tail = chunk_tail_numel(2)  # each chunk ends in a presence flag per parameter and a digest
    assert {op.kind for op in ops} == {"all_gather", "reduce_scatter"}
    gathers = [sizes(op) for op in ops if op.kind == "all_gather"]
    # forward in module order, then again in backward (reshard_after_forward), reversed
    assert gathers == [(s, s * world) for s in shards + shards[::-1]]
    scatters = [sizes(op) for op in ops if op.kind == "reduce_scatter"]
    assert scatters == [((s + tail) * world, s + tail) for s in shards[::-1]]
    # each unit's gradients are reduced after its backward gathered it
    for unit, shard in enumerate(shards):
        backward_gather = max(i for i, op in enumerate(ops)
                              if op.kind == "all_gather" and sizes(op)[0] == shard)
        scatter = next(i for i, op in enumerate(ops)
                       if op.kind == "reduce_scatter" and sizes(op)[1] == shard + tail)
        assert backward_gather < scatter, unit


def test_the_trainer_step_issues_the_same_collectives_at_every_world_size():
    seen = {}
    for world in WORLD_SIZES:
        with fake_world(world):
            seen[world] = step_collectives(TrainerRun(world))
    kinds = {world: [op.kind for op in ops] for world, ops in seen.items()}
    first = kinds[WORLD_SIZES[0]]
    assert all(k == first for k in kinds.values()), kinds
    # nothing but the shards' traffic, the gradient norm's all-reduce and the two that
    # end the step (the statistics: the loss's sum, the largest stop request and memory
    # figures): no object collective, no per-rank exchange
    assert set(first) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert first.count("all_reduce") == 3 and first[-3:] == ["all_reduce"] * 3
    reduced = {world: [op.inputs for op in ops if op.kind == "all_reduce"]
               for world, ops in seen.items()}
    assert all(r == reduced[WORLD_SIZES[0]] for r in reduced.values()), reduced
    assert sum(map(sum, reduced[WORLD_SIZES[0]])) <= 16  # a few numbers each


class TrainerRun:
    """The trainer's step with BlocksRun's interface."""

    def __init__(self, world: int):
        self.trainer = trainer(world)

    def step(self) -> None:
        trainer_step(self.trainer)
