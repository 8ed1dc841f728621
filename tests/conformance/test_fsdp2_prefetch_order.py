"""The order of gathers, reshards and gradient reductions torch's FSDP2 prefetch tests
check (test_fully_shard_comm.py's prefetch tests; test_fully_shard_overlap.py's
overlap, whose timing needs CUDA streams, rests on this order), run on CPU/gloo.

torch records its private unshard / reshard / post-backward calls; here the same
moments are read off fullshard's own groups: a gather is a collective a unit issues, a
reshard one that frees gathered parameters, a reduction a unit's reduce-scatter. The
expected sequences are torch's: forward gathers in order, each unit freed before the
next is gathered unless forward prefetch asks for more; backward gathers the next unit
before the current one's reduction (one ahead by default, more when
``set_modules_to_backward_prefetch`` asks); the root reduces last. One unit per
all-gather (``set_bucket_numel(0)``), as torch issues them. One two-rank launch.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.core.group import GroupState, ParamGroup
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=4, n_heads=2)
LAYERS = [f"layers.{i}" for i in range(CFG.n_layers)]
ROOT = "GPT"


def _events(fn: Callable[[], object]) -> list[tuple[str, str]]:
    """(what, unit) in the order fullshard does them while ``fn`` runs."""
    seen: list[tuple[str, str]] = []
    record, reshard = ParamGroup._record, ParamGroup.reshard
    kinds = {"all-gather": "gather", "reduce-scatter": "reduce"}

    def recording(self, op, numel):
        seen.append((kinds.get(op, op), self.unit_name))
        return record(self, op, numel)

    def resharding(self):
        if self.state is not GroupState.SHARDED:  # a reshard that frees something
            seen.append(("reshard", self.unit_name))
        return reshard(self)

    ParamGroup._record, ParamGroup.reshard = recording, resharding
    try:
        fn()
    finally:
        ParamGroup._record, ParamGroup.reshard = record, reshard
    return seen


def _gpt(setting) -> GPT:
    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=setting)
    fully_shard(model, reshard_after_forward=setting)
    model.set_bucket_numel(0)
    return model


def _grads_match(model: nn.Module, reference: nn.Module) -> bool:
    """Every rank ran the same batch, so the averaged gradients are the reference's."""
    for p, ref in zip(model.parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if p.grad is not None else torch.zeros_like(ref)
        want = ref.grad if ref.grad is not None else torch.zeros_like(ref)
        if not torch.allclose(grad, want, rtol=1e-5, atol=1e-6):
            return False
    return True


def _step_events(model: GPT, forwards: int = 1) -> tuple[list, list, bool]:
    """The events of ``forwards`` forwards then one backward of their summed losses, and
    whether the gradients match a single-process reference's."""
    ids, targets = token_batch(0, 2, CFG.vocab_size, CFG.seq_len)
    torch.manual_seed(0)
    reference = GPT(CFG)
    sum(lm_loss(reference(ids), targets) for _ in range(forwards)).backward()
    losses: list[torch.Tensor] = []
    fwd = _events(lambda: losses.extend(lm_loss(model(ids), targets)
                                        for _ in range(forwards)))
    bwd = _events(lambda: sum(losses).backward())
    return fwd, bwd, _grads_match(model, reference)


def _prefetching(forward_ahead: int = 0, backward_ahead: int = 0) -> tuple[list, list]:
    model = _gpt(True)
    layers = model.layers
    for i, layer in enumerate(layers):
        if forward_ahead and i + forward_ahead < len(layers):
            layer.set_modules_to_forward_prefetch(
                [layers[i + j] for j in range(1, forward_ahead + 1)])
        if backward_ahead and i >= backward_ahead:
            layer.set_modules_to_backward_prefetch(
                [layers[i - j] for j in range(1, backward_ahead + 1)])
    return _step_events(model)


class _TwoHeads(nn.Module):
    """A shared trunk, then two heads whose losses run backward one at a time."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.trunk = nn.Linear(dim, dim)
        self.lin1, self.lin2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        x = self.trunk(x)
        return self.lin1(x), self.lin2(x)


def _one_head_at_a_time() -> tuple[list, list, list, bool]:
    torch.manual_seed(0)
    model = _TwoHeads()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    for i, out in enumerate(reference(x)[::-1]):
        out.sum().backward(retain_graph=i == 0)
    for unit in (model.trunk, model.lin1, model.lin2, model):
        fully_shard(unit)
    model.set_bucket_numel(0)
    outs: list = []
    fwd = _events(lambda: outs.extend(model(x)))
    model.set_is_last_backward(False)
    first = _events(lambda: outs[1].sum().backward(retain_graph=True))
    model.set_is_last_backward(True)
    second = _events(lambda: outs[0].sum().backward())
    return fwd, first, second, _grads_match(model, reference)


def _all_cases() -> dict:
    return {
        "plain": {repr(s): _step_events(_gpt(s)) for s in (True, False, 2, None)},
        "two forwards": {repr(s): _step_events(_gpt(s), 2) for s in (True, False, None)},
        "forward ahead": {n: _prefetching(forward_ahead=n) for n in (1, 2)},
        "backward ahead": {n: _prefetching(backward_ahead=n) for n in (1, 2)},
        "two heads": _one_head_at_a_time(),
    }


@pytest.fixture(scope="module")
def seen() -> dict:
    return run_distributed(_all_cases, 2, timeout=300)[0]


def _forward(reshards: bool) -> list:
    events = [("gather", ROOT)]
    for layer in LAYERS:
        events += [("gather", layer)] + ([("reshard", layer)] if reshards else [])
    return events + ([("reshard", ROOT)] if reshards else [])


def _backward(gathers_root: bool, gathers: bool = True, ahead: int = 1) -> list:
    """torch's backward: the root first (unless kept whole), the last ``ahead`` + 1
    layers gathered before any reduction, then each reduction after the gather
    ``ahead`` layers further on."""
    events = [("gather", ROOT)] if gathers_root and gathers else []
    order = LAYERS[::-1]
    pending = list(order)
    if gathers:
        events += [("gather", pending.pop(0)) for _ in range(ahead + 1)]
    for layer in order:
        events += [("reshard", layer), ("reduce", layer)]
        if gathers and pending:
            events.append(("gather", pending.pop(0)))
    return events + [("reshard", ROOT), ("reduce", ROOT)]


@pytest.mark.slow
@pytest.mark.parametrize("setting", [True, False, 2, None])
def test_one_step_gathers_and_reduces_in_torchs_order(seen, setting):
    fwd, bwd, grads_match = seen["plain"][repr(setting)]
    assert grads_match
    if setting is None:  # the root keeps its parameters, the blocks free theirs
        assert fwd == _forward(True)[:-1], fwd
    else:
        assert fwd == _forward(setting is not False), fwd
    # False: nothing was freed in forward, so nothing is gathered again
    assert bwd == _backward(gathers_root=setting is not None, gathers=setting is not False), bwd


@pytest.mark.slow
def test_forward_prefetch_gathers_the_next_units_before_freeing_the_current(seen):
    one = [("gather", ROOT), ("gather", "layers.0"), ("gather", "layers.1"),
           ("reshard", "layers.0"), ("gather", "layers.2"), ("reshard", "layers.1"),
           ("gather", "layers.3"), ("reshard", "layers.2"), ("reshard", "layers.3"),
           ("reshard", ROOT)]
    two = [("gather", ROOT), ("gather", "layers.0"), ("gather", "layers.1"),
           ("gather", "layers.2"), ("reshard", "layers.0"), ("gather", "layers.3"),
           ("reshard", "layers.1"), ("reshard", "layers.2"), ("reshard", "layers.3"),
           ("reshard", ROOT)]
    for ahead, expected in ((1, one), (2, two)):
        fwd, bwd, grads_match = seen["forward ahead"][ahead]
        assert grads_match, ahead
        assert fwd == expected, (ahead, fwd)
        assert bwd == _backward(gathers_root=True), (ahead, bwd)  # backward as by default


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [1, 2])
def test_backward_prefetch_gathers_as_many_units_ahead_as_asked(seen, ahead):
    fwd, bwd, grads_match = seen["backward ahead"][ahead]
    assert grads_match
    assert fwd == _forward(True), fwd
    assert bwd == _backward(gathers_root=True, ahead=ahead), bwd


def _gathers(events: list) -> list:
    return [unit for what, unit in events if what == "gather"]


@pytest.mark.slow
@pytest.mark.parametrize("setting", [True, False, None])
def test_two_forwards_then_one_backward(seen, setting):
    """The gradients are the two losses' as in one process. Differs from torch
    (docs/conformance.md): torch skips the gathers of units still whole from the first
    forward (False: the second forward gathers nothing; None: the root is not gathered
    again) and reduces each unit once per forward in backward; fullshard's second forward
    frees and gathers every unit again and its backward reduces each unit once, after
    both forwards' gradients."""
    fwd, bwd, grads_match = seen["two forwards"][repr(setting)]
    assert grads_match, setting
    one_forward = [ROOT, *LAYERS]
    assert _gathers(fwd) == one_forward * 2, fwd
    assert [u for what, u in bwd if what == "reduce"] == [*LAYERS[::-1], ROOT], bwd
    if setting is False:
        assert _gathers(bwd) == [], bwd


@pytest.mark.slow
def test_one_head_backward_at_a_time(seen):
    """Two losses of one forward backpropagated one at a time (``retain_graph``), with
    ``set_is_last_backward(False)`` on the first: the gradients are one process's. As in
    torch each backward gathers the head it runs through first and reduces it before the
    trunk. Differs from torch
    (docs/conformance.md): the unused head, whose forward ran with grad, is reduced as
    zeros in each backward (torch's post-backward for it does nothing), and each backward
    gathers all three units (torch's second backward finds the head the first one
    prefetched still whole and gathers only the trunk)."""
    fwd, first, second, grads_match = seen["two heads"]
    assert grads_match
    assert fwd == [("gather", "trunk"), ("reshard", "trunk"), ("gather", "lin1"),
                   ("reshard", "lin1"), ("gather", "lin2"), ("reshard", "lin2")], fwd
    for events, used, unused in ((first, "lin2", "lin1"), (second, "lin1", "lin2")):
        reduced = [u for what, u in events if what == "reduce"]
        assert reduced == [used, "trunk", unused], events
        assert _gathers(events)[0] == used, events
        assert sorted(_gathers(events)) == sorted([used, unused, "trunk"]), events
