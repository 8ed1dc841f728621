"""torch.nn.utils.clip_grad_norm_ itself (not fullshard's) on sharded gradients, as torch's
FSDP2 tests check it (test_fully_shard_clip_grad_norm_.py), in our own words: for the
2-, 1-, 3- and inf-norm the total norm is a DTensor whose full value is one process's,
it costs one all-reduce per mesh dimension, and every gradient is clipped as the single
process clips it. One launch of two ranks runs every norm type.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from fullshard import fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2)
MAX_NORM = 0.05


def _clip_every_norm_type() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for norm_type in (2.0, 1.0, 3.0, float("inf")):
        torch.manual_seed(0)
        model = GPT(CFG)
        reference = copy.deepcopy(model)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        x, y = token_batch(0, 2 * world, CFG.vocab_size, CFG.seq_len)
        lm_loss(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
        lm_loss(reference(x), y).backward()
        before = [p.grad.full_tensor().clone() for p in model.parameters()]

        ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM,
                                                   norm_type=norm_type)
        assert ref_total > MAX_NORM, (norm_type, ref_total)  # the clip scales the gradients
        with CommDebugMode() as comms:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM,
                                                   norm_type=norm_type, foreach=True)
        assert isinstance(total, DTensor), type(total)
        torch.testing.assert_close(total.full_tensor(), ref_total, rtol=1e-5, atol=1e-7)
        all_reduces = comms.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
        assert all_reduces == len(total.placements), (norm_type, all_reduces)
        for (name, p), q, g in zip(model.named_parameters(), reference.parameters(), before):
            clipped = p.grad.full_tensor()
            torch.testing.assert_close(clipped, q.grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{norm_type}-norm, {name}: {m}")
            assert torch.linalg.vector_norm(clipped, ord=norm_type) <= MAX_NORM * (1 + 1e-5)
            assert not torch.count_nonzero(g) or not torch.equal(clipped, g), name


def test_torchs_clip_grad_norm_on_sharded_gradients_is_one_process_clip():
    run_distributed(_clip_every_norm_type, 2)
