"""The process baseline: memory a training process holds before its model exists.

Note [a warm baseline]
Right after ``import torch`` and process-group init a CPU process holds ~230 MB,
but the first training step adds ~40-70 MB that no model-sized term explains:
the autograd engine, the collectives' and CPU kernels' lazy initialization,
DTensor's and fullshard's caches, the allocator's arenas. Measured against the
cold figure, the estimate of a small model comes out 5-7% low at every phase. A
warm baseline runs one fullshard step of a tiny GPT first (a few MB, freed
before measuring), so that the baseline line holds everything but the model.
On CUDA the warm-up also creates the cuBLAS workspaces, which the caching
allocator counts in ``memory_allocated``.
"""

from __future__ import annotations

import gc

import torch

from .process import current_rss_bytes


def usage_bytes(device: torch.device) -> int:
    """Memory in use now: allocated device memory on CUDA, resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return current_rss_bytes()


def warm_baseline_bytes(device: torch.device | str = "cpu") -> int:
    """Run one sharded step of a tiny GPT on ``device``, free it, return usage.

    Collective: call it on every rank of the default process group, at the same
    point (before building the model)."""
    from ..api import fully_shard
    from ..gpt import GPT, GPTConfig, lm_loss

    device = torch.device(device)
    cfg = GPTConfig(vocab_size=128, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    with torch.device(device):
        model = GPT(cfg)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.zeros(1, cfg.seq_len, dtype=torch.long, device=device)
    lm_loss(model(tokens), tokens).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del model, optimizer, tokens
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return usage_bytes(device)
