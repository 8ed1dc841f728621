"""Modules torch's own FSDP2 sharded, found before fullshard touches a model
(core/refusals/torch_fsdp.py): the first such submodule is named, and fully_shard refuses the
model by that name."""

import pytest
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fullshard import fully_shard
from fullshard.core.refusals.torch_fsdp import sharded_by_torch
from fullshard.testing import run_distributed


def _found():
    plain = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    found = [sharded_by_torch(plain)]
    torch_fully_shard(plain[1][1])
    found.append(sharded_by_torch(plain))
    whole = nn.Linear(4, 4)
    torch_fully_shard(whole)
    found.append(sharded_by_torch(whole))
    ours = nn.Sequential(nn.Linear(4, 4))
    fully_shard(ours[0])
    found.append(sharded_by_torch(ours))  # fullshard's units are not torch's
    with pytest.raises(ValueError) as err:
        fully_shard(plain)
    return found, str(err.value)


def test_the_first_module_torch_sharded_is_named_and_refused():
    found, message = run_distributed(_found, 1)[0]
    assert found == [None, "1.1", "", None]
    assert message.startswith("fully_shard(Sequential): submodule '1.1' was sharded by "
                              "torch's fully_shard (torch.distributed.fsdp), not fullshard's")
