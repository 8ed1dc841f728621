"""A unit whose forward ran but whose output no loss of one backward used, used by a
later backward, the first left unsettled by ``set_is_last_backward(False)`` (two
losses backpropagated one at a time, or a head a micro-batch's loss leaves out): its
gradient is the later one's, not None (Note [gradient presence flags]); a parameter
no rank used in any of them stays None. And a group that merges the heads with the
trunk (whose input needs no gradient) is reduced after the trunk's gradients in the kept
graph's second backward too (Note [when a unit's backward is done])."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.testing import run_distributed


class _Branches(nn.Module):
    """A trunk, then heads; the losses use ``first`` or ``second``, never ``never``."""

    def __init__(self, never: bool, dim: int = 8):
        super().__init__()
        self.trunk = nn.Linear(dim, dim)
        self.first, self.second = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.never = nn.Linear(dim, dim) if never else None

    def forward(self, x):
        h = self.trunk(x)
        return {name: getattr(self, name)(h) for name in ("first", "second", "never")
                if getattr(self, name) is not None}


def _grads(model: nn.Module) -> dict:
    return {n: None if p.grad is None else
            (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for n, p in model.named_parameters()}


def _accumulate(bucket_numel: int | None, heads: tuple[str, str], never: bool
                ) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = _Branches(never)
    reference = copy.deepcopy(model)
    for unit in (model.trunk, model.first, model.second, model.never, model):
        if unit is not None:
            fully_shard(unit)
    if bucket_numel is not None:
        model.set_bucket_numel(bucket_numel)
    x = torch.randn(4, 8)  # every rank the same batch: the mean gradient is the local one
    outs, ref_outs = model(x), reference(x)
    for i, head in enumerate(heads):  # one loss at a time, as torch's prefetch test
        last = i == 1
        model.set_is_last_backward(last)
        outs[head].sum().backward(retain_graph=not last)
        ref_outs[head].sum().backward(retain_graph=not last)
    return _grads(model), _grads(reference)


def _cases() -> dict:
    # merged (bucket None) with the trunk, whose input needs no gradient (an unwatched
    # call, Note [when a unit's backward is done]), the heads' group must wait for the
    # trunk's gradients in the kept graph's second backward too
    return {(numel, heads, never): _accumulate(numel, heads, never) for numel in (0, None)
            for heads in (("first", "second"), ("second", "first")) for never in (True, False)}


@pytest.mark.slow
def test_a_gradient_from_a_later_backward_survives_the_earlier_ones_flags():
    for case, (got, want) in run_distributed(_cases, 2)[0].items():
        assert got.get("never.weight") is None and want.get("never.weight") is None, case
        for name, value in want.items():
            if value is not None:
                assert got[name] is not None, f"{case}: {name} lost its gradient"
                torch.testing.assert_close(got[name], value, msg=f"{case}: {name}")

