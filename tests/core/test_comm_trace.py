"""What the collectives leave behind (core/comm.py): a named profiler range for each
collective and copy (none when no profiler runs), and an exit that waits for the last
collective's threads."""

import torch

from fullshard import fully_shard
from fullshard.gpt import lm_loss
from fullshard.testing import run_distributed
from support.small_gpt import rank_batch, sharded_gpt


def _profiled_step_worker():
    from torch.profiler import ProfilerActivity, profile
    model = sharded_gpt()
    x, y = rank_batch()
    lm_loss(model(x), y).backward()  # warm-up: record the order, allocate the pool
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lm_loss(model(x), y).backward()
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if n.startswith("fullshard::"))


def test_profiler_trace_names_every_collective_and_copy():
    names = run_distributed(_profiled_step_worker, 2)[0]
    kinds = {n.split()[0] for n in names}
    assert {"fullshard::all_gather", "fullshard::copy_out", "fullshard::reduce_scatter",
            "fullshard::finish_reduce"} <= kinds, names
    assert "fullshard::all_gather layers.0" in names and "fullshard::reduce_scatter layers.2" in names


def test_no_profiler_range_is_opened_when_no_profiler_runs(monkeypatch):
    from fullshard.core import comm
    opened = []
    monkeypatch.setattr(comm, "record_function", lambda name: opened.append(name))
    with comm.traced("all_gather x"):
        pass
    assert opened == []


def _exit_waits_for_the_last_collective():
    import time

    import torch.nn as nn

    from fullshard.core import comm

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    model[0](torch.randn(2, 4))  # a child's forward first, then the program would end
    waited = comm.settle_before_exit()  # what the exit handler does
    time.sleep(comm.GRACE_S)
    return comm._registered, 0 < waited <= comm.GRACE_S, comm.settle_before_exit() == 0.0


def test_exit_waits_until_the_collective_threads_let_go_of_their_tensors():
    """Note [collectives settle before exit]: a program that ends right after a
    collective waits (at most GRACE_S) before the interpreter finalizes; one that ends
    later does not wait."""
    assert run_distributed(_exit_waits_for_the_last_collective, 2) == [(True, True, True)] * 2
