"""The estimate's host bytes under the delayed update (``delayed_update=True``) against
what a delayed run holds: each offloaded unit's copy of its shard and its second
gradient buffer (Note [the delayed update]), beside its shard, gradients and states."""

import pytest
import torch

from fullshard.gpt import GPTConfig, lm_loss
from fullshard.memory import estimate
from fullshard.testing import run_distributed
from support.offloaded_gpt import gpt_offloaded_as_the_trainer_does, storages_of

BATCH, SEQ = 1, 64
CFG = GPTConfig(vocab_size=256, seq_len=SEQ, d_model=320, n_layers=3, n_heads=4)
FRACTION = f"cpu:{2 / 3!r}"  # the last 2 of 3 blocks on the host, each a group of its own
KWARGS = dict(world_size=2, batch_size=BATCH, seq_len=SEQ, device="cpu", process_baseline=0)


def train_delayed(offload: str) -> dict:
    """3 steps of ``OverlappedStep(delayed=True)`` over the trainer's per-unit policies for
    ``--parallel.offload offload``: the host bytes the offloaded units hold by kind, the
    gradients as every backward from the second on wrote them (the two kept buffers take
    turns), the copies as ``delayed_state_dict`` shows them."""
    import torch.distributed as dist

    from fullshard import OverlappedStep

    model = gpt_offloaded_as_the_trainer_does(CFG, offload)
    opt = OverlappedStep(torch.optim.AdamW(model.parameters(), lr=1e-3), delayed=True)
    gen = torch.Generator().manual_seed(dist.get_rank())
    grads, copies = {}, {}
    for step in range(3):
        tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen)
        lm_loss(model(tokens), torch.roll(tokens, -1, 1)).backward()
        groups = [g for g in model._unit.root.members if g.offload is not None]
        params = [sp.sharded_param for g in groups for sp in g.params]
        if step:
            grads.update(storages_of(p.grad for p in params if p.grad is not None))
        opt.step()
        copies.update(storages_of(opt.delayed_state_dict()["pending"].values()))
        opt.zero_grad(set_to_none=True)
    opt.wait()
    return {"sharded parameters": sum(storages_of(g.flat_shard for g in groups).values()),
            "copies": sum(copies.values()), "gradients": sum(grads.values()),
            "optimizer states": sum(storages_of(v for p in params
                                              for k, v in opt.state[p].items()
                                              if k != "step").values())}


@pytest.mark.slow
def test_the_delayed_copies_are_the_host_bytes_a_delayed_run_adds():
    """2 of 3 blocks offloaded, on 2 ranks: a delayed run's host holds the offloaded
    units' shards, their copies, two gradient buffers each and their AdamW states, which
    is the estimate's host memory with delayed_update=True, byte for byte; the copies and
    the second buffers are what delayed_update adds to the exact run's estimate."""
    exact, delayed = (estimate(CFG, offload=FRACTION, delayed_update=d, **KWARGS)
                      for d in (False, True))
    for rank, held in enumerate(run_distributed(train_delayed, 2, FRACTION, timeout=300)):
        print(f"rank {rank}: measured {held}; estimated host {delayed.host_bytes}, "
              f"exact {exact.host_bytes}")
        assert sum(held.values()) == delayed.host_bytes, (rank, held, delayed.host_bytes)
        assert held["copies"] == held["sharded parameters"] > 0
        added = held["copies"] + held["gradients"] // 2
        assert delayed.host_bytes - exact.host_bytes == added, (rank, held)
    assert delayed.lines == exact.lines  # the device holds nothing more
    assert ", delayed update," in delayed.table().splitlines()[0]


def test_the_delayed_update_with_states_on_disk_is_refused():
    with pytest.raises(ValueError, match="delayed_update=True .* offload='disk'"):
        estimate(CFG, offload="disk", delayed_update=True, **KWARGS)


def test_without_offload_the_delayed_update_adds_nothing():
    """Nothing is stepped on the host thread without offload, so nothing is copied."""
    plain, delayed = (estimate(CFG, delayed_update=d, **KWARGS) for d in (False, True))
    assert delayed.host_bytes == plain.host_bytes == 0 and delayed.lines == plain.lines
    assert "delayed" not in delayed.table().splitlines()[0]
