"""Which form ``state_dict()`` takes (core/features/native_state_dict.py): the FSDP1 front converts
to full tensors at the outermost call only; inside ``native_state_dict()`` every sharded
module hands out its DTensor shards, whichever front built it."""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard.core.features.native_state_dict import is_outermost, native_state_dict
from fullshard.fsdp1 import FullyShardedDataParallel as FSDP
from fullshard.testing import run_distributed


def _forms():
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)))
    outside = model.state_dict()
    assert is_outermost()
    with native_state_dict():
        assert not is_outermost()
        with native_state_dict():  # nested: still inside when the inner one ends
            pass
        assert not is_outermost()
        inside = model.state_dict()
    assert is_outermost()
    return ({k: (type(v).__name__, tuple(v.shape)) for k, v in outside.items()},
            {k: (isinstance(v, DTensor), tuple(v.to_local().shape)) for k, v in inside.items()
             if isinstance(v, torch.Tensor)})


def test_the_outermost_call_converts_and_native_sections_keep_the_shards():
    outside, inside = run_distributed(_forms, 2)[0]
    assert outside["0.weight"] == ("Tensor", (6, 4))  # the FSDP1 default: full tensors
    assert inside["0.weight"] == (True, (3, 4))       # this rank's rows of a DTensor
    assert inside["1.weight"] == (True, (2, 6))       # 3 rows over 2 ranks: 2, then 1
