"""Small units merged into one group (core/buckets.py): one gather and one reduce for
what fits the cap, the rest alone."""

import pytest

from fullshard.gpt import GPT
from fullshard.testing import run_distributed
from support.small_gpt import CFG, count_per_step, sharded_gpt, steps_with_counts

import torch


@pytest.mark.parametrize("raf", [True, False])
def test_collectives_per_step_with_small_units_merged(raf):
    """The root and the three tiny layers fit one bucket: one gather per forward, none in
    backward (a bucket with the root stays gathered), one reduce for everything."""
    steps = run_distributed(count_per_step, 2, raf, 1 << 20)[0]
    for fwd, bwd in steps:
        assert fwd == {"all_gather": 1}
        assert bwd == {"reduce_scatter": 1}, (raf, bwd)


def _bucket_worker():
    model = sharded_gpt(raf=True, bucket_numel=_layer_numel() * 3 // 2)
    return list(steps_with_counts(model, torch.optim.SGD(model.parameters(), lr=0.1), 2))


def _layer_numel():
    return sum(p.numel() for p in GPT(CFG).layers[0].parameters())


def test_buckets_respect_the_size_cap():
    """A cap of 1.5 layers: the small root joins layer 0 ([root, 0] stays gathered from
    forward to backward), layers 1 and 2 stay alone and are gathered again in backward."""
    counts = run_distributed(_bucket_worker, 2)[0]
    assert counts[0] == {"all_gather": 3, "all_gather_async": 2, "reduce_scatter": 3}
    assert counts[1] == {"all_gather": 1, "all_gather_async": 4, "reduce_scatter": 3}
