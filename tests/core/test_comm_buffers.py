"""The pooled communication buffers (``BufferPool``, core/comm.py): filled in the first
steps, reused from then on."""

import pytest
import torch

from fullshard.testing import run_distributed
from support.small_gpt import sharded_gpt, steps_with_counts


def _steady_state_worker(bucket_numel):
    model = sharded_gpt(raf=True, bucket_numel=bucket_numel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    allocations, counts = [], []
    for c in steps_with_counts(model, opt, 4):
        allocations.append(model._unit.root.pool.allocations)
        counts.append(c)
    return allocations, counts


@pytest.mark.parametrize("bucket_numel", [0, 1 << 20], ids=["per_unit", "merged"])
@pytest.mark.slow
def test_steady_state_allocates_no_communication_buffers(bucket_numel):
    allocations, counts = run_distributed(_steady_state_worker, 2, bucket_numel)[0]
    # the first step fills the pool; the second is the first with a recorded order
    # (prefetch changes which buffers overlap); from then on nothing new is allocated
    assert allocations[1] > 0
    assert allocations[1] == allocations[2] == allocations[3], allocations
    assert counts[2] == counts[3]
