"""A three-layer GPT sharded per layer, each rank's batch, and the collectives each step
runs: what the tests of the core's files (tests/core) and of FSDPModule share."""

import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing.counting import count_collectives, count_forward_backward

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=3, n_heads=2)


def sharded_gpt(raf=True, bucket_numel=0, root_raf=None):
    """The GPT of seed 0 with one unit per layer and the root; ``bucket_numel`` merges
    small units (core/buckets.py)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=raf)
    fully_shard(model, reshard_after_forward=root_raf)
    model.set_bucket_numel(bucket_numel)
    return model


def rank_batch(seed=0, n=2):
    """Token ids and their next tokens, different on each rank."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def count_per_step(raf, bucket_numel=0, root_raf=None):
    """Three SGD steps; each step's collectives, as (forward, backward) counts."""
    model = sharded_gpt(raf, bucket_numel, root_raf)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for step in range(3):
        x, y = rank_batch(step)
        per_step.append(count_forward_backward(lambda: lm_loss(model(x), y)))
        opt.step()
        opt.zero_grad()
    return per_step


def steps_with_counts(model, opt, steps):
    """Train ``steps`` steps; yield the collectives of each step's forward + backward."""
    for step in range(steps):
        x, y = rank_batch(step)
        with count_collectives() as c:
            lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        yield dict(c)


def sgd_steps(model, steps):
    """Train ``steps`` SGD steps on each rank's batches; each step's loss and the full
    gradients its backward left, for comparing runs that should agree exactly."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x, y = rank_batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        out.append((loss.item(), [p.grad.full_tensor() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out


def same_steps(a, b) -> bool:
    """Whether two ``sgd_steps`` results agree to the bit."""
    return len(a) == len(b) and all(
        la == lb and len(ga) == len(gb) and all(map(torch.equal, ga, gb))
        for (la, ga), (lb, gb) in zip(a, b))
