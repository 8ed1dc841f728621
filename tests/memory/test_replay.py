"""The memory estimator replays the schedule the runtime runs, event for event.

Both ask core/schedule.py for every decision (Note [one schedule for the runtime and
the estimate]); what each writes on its own is the order of the actions at each
moment. Here the runtime trains two steps on CPU (gloo) while the test records, on
every rank, what decides memory: each group's state changes (gather issued,
gather waited, freed, 1/N kept after forward), every pooled buffer taken or given
back (with its size, dtype and whether the pool kept it), and every gradient
reduction started (with whether it wrote persistent gradients and needed its own
output buffer) and finished. ``estimate`` replays the same model and settings with
the same methods wrapped; the two sequences must be equal.
"""

from __future__ import annotations

import pytest
import torch

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy
from fullshard.core.comm import BufferPool
from fullshard.core.gradients import GradReduction, PendingReduce
from fullshard.core.group import ParamGroup
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.memory import estimate
from fullshard.memory import replay as replay_module
from fullshard.memory.run_settings import ReplayGroup
from fullshard.memory.byte_ledger import BytePool
from fullshard.memory.reduction_replay import ReductionReplay
from fullshard.memory.units import find_units
from fullshard.testing import run_distributed
from fullshard.wrap import auto_wrap

BATCH, SEQ = 2, 16
TINY = GPTConfig(vocab_size=256, seq_len=SEQ, d_model=32, n_layers=3, n_heads=4)
# the root's group (20000 x 448 embedding) is above the pool's 4M elements: its gather
# buffer is not pooled and its gradients are fresh each step; the blocks' are pooled
# and persistent
BIG_ROOT = GPTConfig(vocab_size=20000, seq_len=SEQ, d_model=448, n_layers=2, n_heads=4)

# name: (config, world size, estimate kwargs); bucket_numel=0 keeps one group per unit
CASES = {
    "full_shard": (BIG_ROOT, 2, dict(strategy="full_shard", bucket_numel=0)),
    "reshard_after_forward=False": (TINY, 2, dict(strategy="shard_grad_op", bucket_numel=0)),
    # hpZ needs 1 < N < shard group size: world size 4, N = 2
    "reshard_after_forward=2 (hpZ)": (TINY, 4, dict(reshard_after_forward=2, bucket_numel=0)),
    # root + layers.0 share the root's group, layers.1 + layers.2 another
    "merged small units": (TINY, 2, dict(strategy="full_shard", bucket_numel=30_000)),
    "cpu offload": (TINY, 2, dict(strategy="full_shard", bucket_numel=0, offload=True)),
    "bf16 compute, fp32 reduce": (TINY, 2, dict(strategy="full_shard", bucket_numel=0,
                                                mp_policy=torch.bfloat16)),
    # set_reduce_scatter_max_input_buffers(2): the oldest finishes when the third starts
    "two reductions in flight": (TINY, 2, dict(strategy="full_shard", bucket_numel=0,
                                               reduces_in_flight=2)),
}


def _state(value) -> str:
    return getattr(value, "value", value).replace("-", "_")


def _record(mp: pytest.MonkeyPatch, group_class, pool_class, log: list, keep_ids: dict) -> None:
    """Log state changes of ``group_class`` instances and ``pool_class`` takes and gives.
    ``keep_ids`` holds each logged object so that ids stay unique."""

    def get_state(self):
        return self.__dict__["_recorded_state"]

    def set_state(self, value):
        before = self.__dict__.get("_recorded_state")
        self.__dict__["_recorded_state"] = value
        if before is not None and _state(before) != _state(value):
            keep_ids[id(self)] = self
            log.append(("state", id(self), _state(before), _state(value)))

    mp.setattr(group_class, "state", property(get_state, set_state), raising=False)
    take, give = pool_class.take, pool_class.give

    def logged_take(self, numel, dtype, *args):
        log.append(("take", numel, dtype))
        return take(self, numel, dtype, *args)

    def logged_give(self, buf):
        if buf is None:
            return give(self, buf)
        numel, dtype = (buf.numel(), buf.dtype) if isinstance(buf, torch.Tensor) else buf[2:]
        idle = len(self.idle())
        result = give(self, buf)
        log.append(("give", numel, dtype, len(self.idle()) > idle))
        return result

    mp.setattr(pool_class, "take", logged_take)
    mp.setattr(pool_class, "give", logged_give)


def _named(log: list, names: dict) -> list:
    """Group ids replaced by their units' names; groups that never act themselves dropped
    (those in a batch, which the batch gathers and reduces)."""
    out = []
    for event in log:
        if event[0] in ("state", "reduce", "reduced"):
            if event[1] not in names:
                continue
            event = (event[0], names[event[1]], *event[2:])
        out.append(event)
    return out


# -- the runtime ----------------------------------------------------------------------------
def _train_and_record(cfg: GPTConfig, kwargs: dict) -> list:
    import torch.distributed as dist

    log: list = []
    keep: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        _record(mp, ParamGroup, BufferPool, log, keep)
        reduce_grads, finish = GradReduction.reduce, PendingReduce.finish
        group_of: dict = {}

        def logged_reduce(self, *args, **kw):
            pending = reduce_grads(self, *args, **kw)
            if pending is not None:
                group_of[id(pending)] = self.group
                separate = pending.pending.output is not pending._dest
                log.append(("reduce", id(self.group), pending._views is not None, separate))
            return pending

        def logged_finish(self, *args, **kw):
            result = finish(self, *args, **kw)
            log.append(("reduced", id(group_of.pop(id(self)))))
            return result

        mp.setattr(GradReduction, "reduce", logged_reduce)
        mp.setattr(PendingReduce, "finish", logged_finish)

        model = GPT(cfg)
        fs_kwargs = {}
        raf = kwargs.get("reshard_after_forward",
                         kwargs.get("strategy", "full_shard") == "full_shard")
        if kwargs.get("offload"):
            fs_kwargs["offload_policy"] = CPUOffloadPolicy()
        if kwargs.get("mp_policy") is not None:
            fs_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=kwargs["mp_policy"],
                                                          reduce_dtype=torch.float32)
        auto_wrap(model, reshard_after_forward=raf, **fs_kwargs)
        if "bucket_numel" in kwargs:
            model.set_bucket_numel(kwargs["bucket_numel"])
        if kwargs.get("reduces_in_flight", 1) > 1:
            model.set_reduce_scatter_max_input_buffers(kwargs["reduces_in_flight"])
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(2):
            log.append(("step",))
            tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
            lm_loss(model(tokens), tokens).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
        root = model._unit.root
        names = {id(g): tuple(u.name for u in units) for g, units in root.members.items()}
    return _named(log, names)


# -- the replay -----------------------------------------------------------------------------
def _replay_and_record(mp: pytest.MonkeyPatch, cfg: GPTConfig, world: int, kwargs: dict) -> list:
    log: list = []
    keep: dict = {}
    _record(mp, ReplayGroup, BytePool, log, keep)
    Replay = replay_module.Replay
    step, reduce, finish = Replay._step, ReductionReplay._reduce, ReductionReplay._finish_one
    replays: list = []

    def logged_step(self):
        replays.append(self)
        log.append(("step",))
        return step(self)

    def logged_reduce(self, group):
        pending = reduce(self, group)
        if pending is not None:
            log.append(("reduce", id(group), group.persistent_grads, pending[3] is not None))
        return pending

    def logged_finish(self, pending):
        result = finish(self, pending)
        log.append(("reduced", id(pending[0])))
        return result

    mp.setattr(Replay, "_step", logged_step)
    mp.setattr(ReductionReplay, "_reduce", logged_reduce)
    mp.setattr(ReductionReplay, "_finish_one", logged_finish)
    estimate(cfg, world_size=world, batch_size=BATCH, seq_len=SEQ, device="cpu",
             process_baseline=0, **kwargs)

    with torch.device("meta"):  # the estimator's units, named by path as fully_shard does
        model = GPT(cfg)
    paths = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
    unit_names = [paths[id(u)] for u in find_units(model)]
    names = {id(g): tuple(unit_names[u] for u in g.layout.units) for g in replays[0].groups}
    return _named(log, names)


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            context = "\n".join(f"  {j}: runtime {a[j]}  replay {b[j]}"
                                for j in range(max(0, i - 6), min(len(a), len(b), i + 3)))
            return f"event {i} differs:\n{context}"
    return f"lengths differ: runtime {len(a)} events, replay {len(b)}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_replay_makes_the_runtime_schedule(case, monkeypatch):
    cfg, world, kwargs = CASES[case]
    runtime = run_distributed(_train_and_record, world, cfg, kwargs, timeout=300)
    replayed = _replay_and_record(monkeypatch, cfg, world, kwargs)
    kinds = {e[0] for e in replayed}
    assert {"take", "give", "state", "reduce", "reduced"} <= kinds, kinds
    for rank, events in enumerate(runtime):
        assert events == replayed, f"rank {rank}, {case}: " + _first_difference(events, replayed)


def test_more_reductions_in_flight_hold_more_send_buffers():
    one, two = (estimate(BIG_ROOT, world_size=2, batch_size=BATCH, seq_len=SEQ, device="cpu",
                         process_baseline=0, bucket_numel=0, reduces_in_flight=n)
                for n in (1, 2))
    # the blocks' reductions overlap the root's: at least a block's send buffer more
    assert two.total > one.total, (one.total, two.total)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="reduces_in_flight must be an int >= 1"):
            estimate(TINY, world_size=2, device="cpu", reduces_in_flight=bad)
