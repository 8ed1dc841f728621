"""Each rank's shards are 1/N of the model at every world size (fake process group)."""

import pytest

from fullshard.testing.fake_world import fake_world
from fullshard.testing.scale import WORLD_SIZES, BlocksRun, row_blocks, shard_bytes

pytestmark = pytest.mark.scale


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_each_rank_holds_one_nth_of_parameters_gradients_and_states(world):
    with fake_world(world):
        run = BlocksRun()
        run.step()  # AdamW's states exist from its first step on
        run.forward_backward()
        shards = shard_bytes(run.model, run.optimizer)
    full = sum(p.numel() * p.element_size() for p in row_blocks().parameters())
    # every parameter's rows divide evenly: nothing padded, nothing replicated
    assert shards.params * world == full
    assert shards.grads * world == full
    assert shards.states * world == 2 * full  # AdamW: exp_avg and exp_avg_sq
