"""The estimate counts pinned host buffers at the caching host allocator's block sizes
(Note [pinned host blocks]): CUDA compute with CPU offload pins each unit's flat shard
and sharded gradients, and the allocator rounds each request up to a power of two."""

import math

import pytest
import torch

from fullshard.core.gradients import chunk_tail_numel
from fullshard.gpt import GPT, GPTConfig
from fullshard.memory import estimate
from fullshard.memory.pinned import pinned_block_bytes, rounding_limit_bytes

CFG = GPTConfig(vocab_size=256, seq_len=64, d_model=320, n_layers=3, n_heads=4)
KWARGS = dict(world_size=2, batch_size=1, seq_len=64, process_baseline=0, bucket_numel=0)
NOT_ROUNDED = "pinned_max_round_threshold_mb:0"


def test_a_request_takes_the_next_power_of_two_up_to_the_configured_limit():
    assert [pinned_block_bytes(n, {}) for n in (1, 220, 256, 257, 3 << 20)] == \
        [1, 256, 256, 512, 4 << 20]
    assert pinned_block_bytes(0, {}) == 0
    conf = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,pinned_max_cached_size_mb:2"}
    assert rounding_limit_bytes(conf) == 2 << 20
    assert pinned_block_bytes(3 << 20, conf) == 3 << 20  # above the limit: its own size
    assert pinned_block_bytes(1000, conf) == 1024
    both = {"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:1", **conf}
    assert rounding_limit_bytes(both) == 1 << 20
    assert rounding_limit_bytes({}) == math.inf


def _unit_shard_bytes() -> list[tuple[int, int]]:
    """Each unit's flat shard and sharded gradients in fp32 at world size 2 (rows split,
    the first rank's share rounded up; the gradients' chunk also carries a flag per
    parameter and the digest, core/gradients.py): the three blocks, then the root's."""
    with torch.device("meta"):
        model = GPT(CFG)

    def shard_and_grads(params) -> tuple[int, int]:
        params = list(params)
        numel = sum(math.ceil(p.shape[0] / 2) * (p.numel() // max(p.shape[0], 1))
                    if p.dim() else p.numel() for p in params)
        return 4 * numel, 4 * (numel + chunk_tail_numel(len(params)))

    blocks = [shard_and_grads(layer.parameters()) for layer in model.layers]
    in_blocks = {id(p) for layer in model.layers for p in layer.parameters()}
    return blocks + [shard_and_grads(p for p in model.parameters() if id(p) not in in_blocks)]


def _rounding(nbytes: int) -> int:
    return pinned_block_bytes(nbytes, {}) - nbytes


def test_the_cuda_estimate_counts_each_pinned_shard_and_gradient_at_its_block(monkeypatch):
    sizes = _unit_shard_bytes()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", NOT_ROUNDED)
    exact = estimate(CFG, offload="cpu", device="cuda", **KWARGS)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    rounded = estimate(CFG, offload="cpu", device="cuda", **KWARGS)
    # a shard and its gradients per unit, each rounded up on its own
    added = sum(_rounding(shard) + _rounding(grads) for shard, grads in sizes)
    assert added > 0
    assert rounded.host_bytes - exact.host_bytes == added
    assert rounded.total == exact.total  # the device's bytes are not pinned host memory


@pytest.mark.parametrize("offload", ["cpu", "none"])
def test_nothing_is_rounded_on_the_cpu_or_without_offload(monkeypatch, offload):
    device = "cpu" if offload == "cpu" else "cuda"
    plain = estimate(CFG, offload=offload, device=device, **KWARGS)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", NOT_ROUNDED)
    assert estimate(CFG, offload=offload, device=device, **KWARGS).host_bytes == plain.host_bytes


def test_the_delayed_copy_and_second_gradients_are_pinned_blocks_too(monkeypatch):
    sizes = _unit_shard_bytes()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", NOT_ROUNDED)
    exact = estimate(CFG, offload="cpu", device="cuda", delayed_update=True, **KWARGS)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    rounded = estimate(CFG, offload="cpu", device="cuda", delayed_update=True, **KWARGS)
    assert rounded.host_bytes - exact.host_bytes == sum(
        2 * (_rounding(shard) + _rounding(grads)) for shard, grads in sizes)
