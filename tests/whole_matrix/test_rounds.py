"""A whole-matrix step in rounds (Note [whole-matrix optimizers], "In rounds"): each round
steps one parameter per owner and sends its rows back while the next round steps; an
optimizer not declared to step each parameter alone steps in one round."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

from fullshard.testing import run_distributed
from fullshard.testing.parity import full_value
from support.whole_matrix_runs import max_diff, mlp_blocks, shard_blocks, train_steps

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon")

EVENTS: list = []
SEEN_GRADS: list = []  # weak references to the whole gradients earlier calls stepped


class _RecordingMuon(torch.optim.Muon):
    """torch's Muon, noting each call of its step, how many parameters it held and how
    many whole gradients of earlier rounds are still alive."""

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        EVENTS.append(("step", len(params)))
        EVENTS.append(("alive", sum(ref() is not None for ref in SEEN_GRADS)))
        SEEN_GRADS.extend(weakref.ref(p.grad) for p in params)
        return super().step(closure)


class _SharedCountMuon(_RecordingMuon):
    """Registered without steps_each_alone: fullshard must step it in one call."""


def _record(fn) -> str:
    """The step's all-to-alls ('a') and optimizer step calls ('S') in the order issued."""
    real = dist.all_to_all_single

    def counted(*args, **kwargs):
        EVENTS.append(("a2a", 0))
        return real(*args, **kwargs)

    EVENTS.clear()
    dist.all_to_all_single = counted
    try:
        fn()
    finally:
        dist.all_to_all_single = real
    return "".join({"a2a": "a", "step": "S"}.get(kind, "") for kind, _ in EVENTS)


def _rounds(kind: str) -> dict:
    from fullshard import register_whole_matrix_optimizer
    if kind == "each alone":
        register_whole_matrix_optimizer(_RecordingMuon, steps_each_alone=True)
    elif kind == "one call":
        register_whole_matrix_optimizer(_SharedCountMuon)
    else:  # an undeclared override of Muon's step, whose super().step() fires the hooks
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))])  # torch wraps Muon.step
    cls = _SharedCountMuon if kind == "one call" else _RecordingMuon
    rank, world = dist.get_rank(), dist.get_world_size()
    model, same_grads = shard_blocks(mlp_blocks()), mlp_blocks()
    opts = [cls([p for p in m.parameters() if p.ndim == 2], lr=0.02, weight_decay=0.1)
            for m in (model, same_grads)]
    hooks = [{"pre": 0, "post": 0}, {"pre": 0, "post": 0}]
    for opt, counts in zip(opts, hooks):
        opt.register_step_pre_hook(lambda *a, c=counts: c.__setitem__("pre", c["pre"] + 1))
        opt.register_step_post_hook(lambda *a, c=counts: c.__setitem__("post", c["post"] + 1))
    out = {"order": [], "held": [], "diff": [], "alive": []}
    for step in range(3):
        train_steps(model, [], 1, rank, world, first=step)
        for p, q in zip(model.parameters(), same_grads.parameters()):
            q.grad = full_value(p.grad) if p.grad is not None else None
        SEEN_GRADS.clear()
        out["order"].append(_record(opts[0].step))
        out["held"].append([n for kind_, n in EVENTS if kind_ == "step"])
        out["alive"].append(max(n for kind_, n in EVENTS if kind_ == "alive"))
        opts[1].step()
        for opt in opts:
            opt.zero_grad()
        out["diff"].append(max_diff(model, same_grads))
    out["hooks"] = hooks
    return out


@pytest.mark.parametrize("kind", ["each alone", "one call", "override"])
def test_a_muon_step_runs_in_rounds_sending_rows_back_while_the_next_steps(kind):
    # six matrices of one cost over two ranks: three each, one per round
    for out in run_distributed(_rounds, 2, kind):
        assert out["diff"] == [0.0, 0.0, 0.0], out
        sharded, one_process = out["hooks"]
        assert sharded == one_process, out  # once per step(), not once per round
        if kind == "each alone":
            # the first two gathers, then each round: step, its rows back, the next gather;
            # the last round is the stock step's
            assert out["order"] == ["aaSaaSaSa"] * 3, out
            assert out["held"] == [[1, 1, 1]] * 3, out
            # a round's whole gradient is freed before the next round steps
            assert out["alive"] == [0, 0, 0], out
        else:
            assert out["order"] == ["aSa"] * 3, out
            assert out["held"] == [[3]] * 3, out


def _host_reads_per_step() -> list[dict]:
    """What each of three Muon steps reads on the host (torch.equal, tolist, item, bool)
    and how often it places the matrices on their owners."""
    import fullshard.whole_matrix as whole_matrix
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_blocks(mlp_blocks())
    opt = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
    counts: dict[str, int] = {}
    watched = [(torch, "equal"), (torch.Tensor, "tolist"), (torch.Tensor, "item"),
               (torch.Tensor, "__bool__"), (whole_matrix, "owners_by_cost")]
    real = [getattr(owner, name) for owner, name in watched]

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    per_step = []
    try:
        for (owner, name), fn in zip(watched, real):
            setattr(owner, name, counted(name, fn))
        for step in range(3):
            train_steps(model, [], 1, rank, world, first=step)
            counts.clear()
            opt.step()
            opt.zero_grad()
            per_step.append(dict(counts))
    finally:
        for (owner, name), fn in zip(watched, real):
            setattr(owner, name, fn)
    return per_step


@pytest.mark.slow
def test_a_step_reads_the_host_once_and_places_the_owners_once():
    """Six matrices in one shard group: whether each one's rows changed is read with the
    step's one agreement (no torch.equal per matrix), and the owners placed at the first
    step stay placed, not recomputed each step."""
    for per_step in run_distributed(_host_reads_per_step, 2):
        assert per_step == [{"owners_by_cost": 1, "tolist": 1}, {"tolist": 1}, {"tolist": 1}]
