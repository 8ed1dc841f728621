"""Converting a sharded model's dtype, as torch's FSDP2 tests check it
(test_fully_shard_conversion.py, test_fully_shard_grad_dtype.py: the parts torch 2.13
to 2.15 have), in our own words:

- ``model.to(torch.bfloat16)`` after ``fully_shard`` does what it does to a plain
  module: parameters (trainable and frozen) and any gradients already there become
  bf16 DTensors with the same values; the forward, the gradients after backward and an
  SGD and an Adam step then equal the plain module's, twice (gradients set to None
  between); a conversion to the dtype the model has already keeps every parameter object;
- ``MixedPrecisionPolicy`` keeps its four positional fields (param, reduce, output
  dtype, cast_forward_inputs), and a ``grad_dtype=`` field (torch after 2.15) is not
  taken on 2.13-2.15, by either implementation.

Every rank feeds the same rows, so the averaged gradients are the plain module's bit
for bit. One launch of two ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.testing import run_distributed


def _same(model: nn.Module, plain: nn.Module, what: str) -> None:
    for (name, p), ref in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert isinstance(p, DTensor), (what, name)
        assert (p.dtype, p.requires_grad) == (ref.dtype, ref.requires_grad), (what, name)
        assert torch.equal(p.full_tensor(), ref), (what, name)
        if ref.grad is None:
            assert p.grad is None, (what, name)
        else:
            assert isinstance(p.grad, DTensor) and p.grad.dtype == ref.grad.dtype, (what, name)
            assert torch.equal(p.grad.full_tensor(), ref.grad), (what, name)


def _to_bfloat16(existing_grad: bool) -> None:
    what = f"to(bfloat16), gradients there before {existing_grad}"
    plain = nn.Linear(4, 4)
    with torch.no_grad():
        plain.weight.fill_(0.25)
        plain.bias.fill_(0.125)
    plain.bias.requires_grad_(False)
    model = copy.deepcopy(plain)
    fully_shard(model)
    if existing_grad:
        for m in (model, plain):
            m.weight.grad = torch.ones_like(m.weight)
    for m in (model, plain):
        m.to(torch.bfloat16)
    _same(model, plain, what)
    x = (torch.arange(8, dtype=torch.float32).view(2, 4) / 8).bfloat16()
    for step in range(2):
        if step:
            model.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
        expected, out = plain(x), model(x)
        assert torch.equal(out, expected), (what, step)
        expected.sum().backward()
        out.sum().backward()
        _same(model, plain, f"{what}, backward {step}")
        for optimizer in (torch.optim.SGD, torch.optim.Adam):
            for m in (model, plain):
                optimizer(m.parameters(), lr=0.01).step()
            _same(model, plain, f"{what}, {optimizer.__name__} step {step}")


def _same_dtype_keeps_parameters() -> None:
    model = fully_shard(nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    before = [(p, p.grad) for p in model.parameters()]
    model.float()
    assert all(p is q and p.grad is g for (q, g), p in zip(before, model.parameters()))


def _policy_fields() -> None:
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, False)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype,
            policy.cast_forward_inputs) == (torch.bfloat16, torch.float32, None, False)
    with pytest.raises(TypeError):
        MixedPrecisionPolicy(grad_dtype=torch.float32)


def _all_cases() -> None:
    for existing_grad in (False, True):
        _to_bfloat16(existing_grad)
    _same_dtype_keeps_parameters()
    _policy_fields()


@pytest.mark.slow
def test_dtype_conversion_after_sharding_is_a_plain_modules():
    run_distributed(_all_cases, 2)
