"""One rank that communicates: ``fullshard.testing.collectives_at_one_rank`` turns off the
world-size-1 shortcuts (Note [shard groups of one rank]) so that a one-GPU machine runs
the gathers, reductions, copy stream and pooled buffers the CUDA lane is there to check.
Here on one gloo rank: the same training as one process, with collectives issued."""

import pytest
import torch

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fullshard.core.comm import skips_collectives
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.core.state import unit_of
from fullshard.testing import collectives_at_one_rank, run_distributed
from fullshard.testing.counting import count_collectives
from fullshard.testing.models import token_batch
from fullshard.testing.parity import check_parity

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _trains_like_one_process(options: dict, shortcuts: bool):
    if not shortcuts:
        collectives_at_one_rank()
    seen = {}

    def shard(model):
        for layer in model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        seen["model"] = model

    def loss(model, batch):
        return lm_loss(model(batch[0]).float(), batch[1])

    with count_collectives() as counts:
        check_parity(lambda: GPT(CFG), shard, lambda step: token_batch(step, 4, CFG.vocab_size,
                                                                        CFG.seq_len),
                     loss, steps=3, optimizer="adamw", lr=1e-3,
                     # bf16 compute against an fp32 reference: close, not equal
                     rtol=5e-2 if "mp_policy" in options else 1e-5,
                     atol=5e-3 if "mp_policy" in options else 1e-6)
    group = unit_of(seen["model"].layers[0]).group
    return dict(counts), group.aliases_shard, skips_collectives(1)


@pytest.mark.slow
def test_one_rank_issues_its_collectives_and_trains_like_one_process():
    variants = [{}, {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
                {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)}]
    for options in variants:
        counts, aliased, skips = run_distributed(_trains_like_one_process, 1, options, False)[0]
        assert not skips and not aliased, options
        # the tiny units share one group (core/buckets.py): gathered and reduced each step
        assert counts.get("all_gather_async", 0) + counts.get("all_gather", 0) >= 3, counts
        assert counts["reduce_scatter"] >= 3, (options, counts)


def test_the_shortcuts_stay_the_default():
    counts, aliased, skips = run_distributed(_trains_like_one_process, 1, {}, True)[0]
    assert skips and aliased and counts == {}
