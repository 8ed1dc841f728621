"""The calls of an optimizer's step (Note [the calls of an optimizer step]): nested calls,
a step that raises, the step run alone, and LR schedulers beside the guard."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from fullshard.step_calls import step_alone
from fullshard.testing import run_distributed
from fullshard.testing.parity import full_value


def _pair():
    """The same two-layer model twice, sharded one unit per layer."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        models.append(model)
    return models


def _backward(model, step: int) -> None:
    gen = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    model(torch.randn(3, 8, generator=gen)).pow(2).sum().backward()


def _holds_dtensors(opt) -> bool:
    return (all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
            and all(isinstance(p, DTensor) for p in opt.state)
            and all(isinstance(v, DTensor) for s in opt.state.values()
                    for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0))


def _raise_in_a_later_step() -> list:
    raising, plain = _pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (raising, plain)]
    seen = []
    for step in range(4):
        for model in (raising, plain):
            _backward(model, step)
        boom = None
        if step == 1:  # the step updates, then a user's post-hook raises
            boom = opts[0].register_step_post_hook(
                lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        try:
            opts[0].step()
        except RuntimeError:
            boom.remove()
            seen.append(_holds_dtensors(opts[0]))  # as the handler sees it
        opts[1].step()
        for opt in opts:
            opt.zero_grad()
    same = all(torch.equal(full_value(p), full_value(q))
               for p, q in zip(raising.parameters(), plain.parameters()))
    return seen + [same, _holds_dtensors(opts[0])]


def test_a_step_that_raises_leaves_dtensors_as_it_leaves_and_later_steps_train_on():
    # a depth count alone would take the step after the error for a nested one: it would
    # leave the swap in place and step the local tensors with the error's gradients
    for held_at_error, same_weights, held_at_end in run_distributed(_raise_in_a_later_step, 2):
        assert held_at_error, "the optimizer held local tensors when the error left step()"
        assert same_weights, "the steps after the error trained differently"
        assert held_at_end


class _CountingAdamW(torch.optim.AdamW):
    """An override that calls super().step(), itself hooked (AdamW is built too)."""

    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        return super().step(closure)


class _FailingAfterSuper(_CountingAdamW):
    """An override that raises after its super().step() has run (and closed its hooks)."""

    def step(self, closure=None):
        out = super().step(closure)
        if self.calls == 2:
            raise ValueError("after super")
        return out


def _nested(kind: str) -> list:
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # torch wraps AdamW.step too
    cls = _FailingAfterSuper if kind == "raises" else _CountingAdamW
    sharded, _ = _pair()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))  # one rank: the same gradients
    out = []
    for model in (sharded, plain):
        opt = cls(model.parameters(), lr=1e-2)
        counts = {"pre": 0, "post": 0}
        opt.register_step_pre_hook(lambda *a: counts.__setitem__("pre", counts["pre"] + 1))
        opt.register_step_post_hook(lambda *a: counts.__setitem__("post", counts["post"] + 1))
        held = []
        for step in range(3):
            _backward(model, step)
            try:
                opt.step()
            except ValueError:
                held.append(model is plain or _holds_dtensors(opt))
            opt.zero_grad()
        out.append(([full_value(p) for p in model.parameters()], counts, held,
                    model is plain or _holds_dtensors(opt)))
    (got, got_counts, held, held_at_end), (expected, expected_counts, _, _) = out
    return [all(torch.equal(a, b) for a, b in zip(got, expected)),
            got_counts == expected_counts, held, held_at_end]


@pytest.mark.parametrize("kind", ["returns", "raises"])
def test_an_override_calling_super_step_trains_as_without_fullshard_even_if_it_raises(kind):
    # torch fires the hooks of both calls (the override's and AdamW's); fullshard's
    # swap and checks run once, for the outer one, and a raise after super() is undone
    for same, same_counts, held, held_at_end in run_distributed(_nested, 1, kind):
        assert same and same_counts
        assert held == ([] if kind == "returns" else [True]) and held_at_end


class _Scaled(torch.optim.SGD):
    """A subclass with an attribute of its own that its step reads."""

    def __init__(self, params, scale):
        super().__init__(params, lr=0.1)
        self.scale = scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * self.scale)
                self.state[p]["n"] = self.state[p].get("n", 0) + 1


def test_the_step_alone_runs_without_the_optimizers_hooks_on_its_state():
    # torch's copy protocol is what keeps the hooks out (Optimizer.__getstate__ and
    # __setstate__): checked on every torch lane
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = _Scaled([p], scale=2.0)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    step_alone(opt)
    assert calls == []
    assert torch.equal(p.detach(), torch.full((3,), 0.8))  # the subclass's scale read
    assert opt.state[p] == {"n": 1}  # the original's state, advanced
    opt.step()
    assert calls == ["pre", "post"] and opt.state[p] == {"n": 2}


def _with_scheduler(when: str) -> list:
    model, _ = _pair()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = None
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "optimizer.step() has been overridden", ...
        for step in range(3):
            if step == (0 if when == "before" else 1) and sched is None:
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            _backward(model, step)
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_lr_scheduler_built_before_or_after_the_first_step_sees_each_step(when):
    expected = [0.5, 0.25, 0.125] if when == "before" else [1.0, 0.5, 0.25]
    assert run_distributed(_with_scheduler, 1, when) == [expected]
