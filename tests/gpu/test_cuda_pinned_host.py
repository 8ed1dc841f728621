"""CUDA lane: what CPU offload pins is what the estimate counts (Note [pinned host
blocks]): the pinned allocator's bytes grow by each unit's flat shard at its power-of-two
block when the model is sharded, and by each unit's sharded gradients at theirs after
the first backward (one rank on the first GPU; the collectives' shortcuts stay on, the
offload's host buffers are the same)."""

import lanes

lanes.require_cuda_lane()

import torch  # noqa: E402 - only once the lane is known to run

from fullshard import CPUOffloadPolicy, fully_shard  # noqa: E402
from fullshard.core.state import unit_of  # noqa: E402
from fullshard.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from fullshard.memory.pinned import pinned_block_bytes  # noqa: E402
from fullshard.testing import run_distributed  # noqa: E402

# Unit sizes that are not powers of two, so the rounding shows.
CFG = GPTConfig(vocab_size=96, seq_len=16, d_model=80, n_layers=2, n_heads=4)


def _pinned_bytes() -> int:
    return torch.cuda.host_memory_stats()["allocated_bytes.current"]


def _grown() -> dict:
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    before = _pinned_bytes()
    for layer in model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    sharded = _pinned_bytes()
    units = [unit_of(m) for m in (*model.layers, model)]
    storages = [u.group.storage for u in units]
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), device="cuda")
    lm_loss(model(tokens), torch.roll(tokens, -1, 1)).backward()
    torch.cuda.synchronize()
    shard_bytes = [s.numel * 4 for s in storages]
    # the sharded gradients are views of one buffer per unit: each buffer once
    buffers = {}
    for p in model.parameters():
        storage = p.grad.to_local().untyped_storage()
        buffers[storage.data_ptr()] = storage.nbytes()
    grad_bytes = list(buffers.values())
    return {"shards": sharded - before, "grads": _pinned_bytes() - sharded,
            "want_shards": sum(pinned_block_bytes(b) for b in shard_bytes),
            "want_grads": sum(pinned_block_bytes(b) for b in grad_bytes),
            "unrounded": sum(shard_bytes)}


def test_offload_pins_each_shard_and_its_gradients_at_a_power_of_two_block():
    (got,) = run_distributed(_grown, 1, backend="nccl")
    assert got["want_shards"] > got["unrounded"]  # the sizes round up
    assert got["shards"] == got["want_shards"], got
    assert got["grads"] == got["want_grads"], got  # each unit's gradient buffer, rounded
