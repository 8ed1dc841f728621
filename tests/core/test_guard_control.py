"""The control channel (core/guard/control.py, Note [one control group]): one gloo group per
set of ranks, shared by the divergence guard and the check-ins of collective functions,
waiting as long as the process group does; at most one operation in flight."""

import datetime
import os

import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.core.guard import control
from fullshard.core.state import unit_of
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=2, n_heads=2)


def _channels():
    os.environ.pop(control.TIMEOUT_VARIABLE, None)
    made = []
    real = dist.new_group

    def spy(*args, **kwargs):
        made.append(kwargs.get("group_desc"))
        return real(*args, **kwargs)

    dist.new_group = spy
    try:
        models = []
        for _ in range(2):  # two models over the same ranks: one channel
            model = GPT(CFG)
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
            lm_loss(model(x), x).backward()
            models.append(model)
    finally:
        dist.new_group = real
    guards = [unit_of(m).root.guard for m in models]
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=77))
    return {"made": made.count(control.GROUP_DESC),
            "shared": guards[0].channel is guards[1].channel is control.channel_of([0, 1]),
            "limit": guards[0].limit_s, "world_timeout": control.process_group_timeout(),
            "short": control.process_group_timeout(short)}


def test_one_control_group_for_the_guard_and_the_check_ins():
    for result in run_distributed(_channels, 2):
        assert result["made"] == 1, result
        assert result["shared"], result
        assert result["limit"] == result["world_timeout"], result  # the process group's
        assert result["short"] == 77.0, result


class _Op:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __call__(self):
        self.log.append(self.name)


def test_one_operation_in_flight_finished_before_the_next():
    channel = control.Channel.__new__(control.Channel)
    channel._in_flight = None
    log = []
    channel.hold(_Op(log, "first"))
    assert log == []
    channel.hold(_Op(log, "second"))  # the first is finished before the second is held
    assert log == ["first"]
    channel.drain()
    channel.drain()
    assert log == ["first", "second"]


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return count


def _sockets_made_by_fully_shard():
    before = _sockets()
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    for _ in range(2):
        lm_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
    unit_of(model).root.guard.check(0)  # one comparison on the channel: a ring's traffic
    return _sockets() - before


def test_the_control_group_connects_to_the_peers_it_talks_to_only():
    """At 4 ranks a group connected to every peer holds 3 sockets and its listener in
    each process; the control group holds its listener and, after an all-reduce, the
    sockets to its two ring neighbours at most."""
    for made in run_distributed(_sockets_made_by_fully_shard, 4):
        assert made <= 3, made
