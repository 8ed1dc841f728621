"""Errors raised where torch's FSDP2 raises for the same misuse (core/refusals/torch_errors.py):
torch's exception type and message first, so code written against torch's catches and
matches them, and fullshard's guidance after; bad input is also a ValueError."""

import pytest
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from fullshard import fully_shard
from fullshard.core.refusals.torch_errors import FullyShardArgumentError, torch_first
from fullshard.testing import run_distributed


def test_torchs_message_comes_first_on_one_line():
    assert torch_first("Expected Shard, got X", "fully_shard(M): use Shard(0).") == \
        "Expected Shard, got X fully_shard(M): use Shard(0)."
    assert issubclass(FullyShardArgumentError, AssertionError)
    assert issubclass(FullyShardArgumentError, ValueError)


def _bad_placements():
    caught = []
    for placement in (Replicate(), Shard(2)):
        with pytest.raises(AssertionError) as err:  # what torch's own tests expect
            fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p, pl=placement: pl)
        assert isinstance(err.value, ValueError)
        caught.append(str(err.value))
    return caught


def test_a_placement_torch_refuses_is_refused_with_torchs_words_then_ours():
    replicate, out_of_range = run_distributed(_bad_placements, 1)[0]
    assert replicate.startswith("Expected Shard, got <class "), replicate
    assert out_of_range.startswith("Shard dim 2 is invalid for 2D tensor: torch.Size([4, 4])")
    assert "fully_shard(Linear)" in replicate and "fully_shard(Linear)" in out_of_range
