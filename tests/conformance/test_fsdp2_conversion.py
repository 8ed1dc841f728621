"""Converting a sharded model's dtype, as torch's FSDP2 tests check it
(test_fully_shard_conversion.py, test_fully_shard_grad_dtype.py: the parts torch 2.13
to 2.15 have), in our own words:

- ``model.to(torch.bfloat16)`` after ``fully_shard`` does what it does to a plain
  module: parameters (trainable and frozen) and any gradients already there become
  bf16 DTensors with the same values; the forward, the gradients after backward and an
  SGD and an Adam step then equal the plain module's, twice (gradients set to None
  between); a conversion to the dtype the model has already keeps every parameter object;
- bf16 compute with gradients summed (divide factor 1, sum reductions forced) in a
  bf16 or fp32 ``reduce_dtype``: the fp32 sharded gradient is the ranks' sum in that
  dtype, and an unused parameter reduced anyway (``set_reduce_scatter_unused_params``)
  gets a zero fp32 gradient;
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
import torch.distributed as dist
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


class _Projection(nn.Module):
    """One fp32 weight used (in bf16 compute) and one never used."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((32, 32), 0.125))
        self.unused = nn.Parameter(torch.zeros(32, 32))

    def forward(self, x):
        return x @ self.weight.T


def _summed_in(reduce_dtype: torch.dtype) -> None:
    """bf16 compute, gradients summed (not averaged) in ``reduce_dtype``, the unused
    parameter's gradient reduced too: a zero fp32 gradient, not None."""
    model = _Projection()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                      reduce_dtype=reduce_dtype))
    model.set_reduce_scatter_unused_params(True)
    model.set_gradient_divide_factor(1.0)
    model.set_force_sum_reduction_for_comms(True)
    x = torch.full((2, 32), 1.0078125, dtype=torch.bfloat16)
    out = model(x)
    grad_out = torch.full_like(out, 1.0078125 * (dist.get_rank() + 1))
    out.backward(grad_out)
    local = (grad_out.T @ x).to(reduce_dtype)  # backward's bf16 product, then the cast
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    grad = model.weight.grad
    assert grad.dtype == torch.float32, grad.dtype
    assert torch.equal(grad.full_tensor(), total.float()), reduce_dtype
    unused = model.unused.grad
    assert unused is not None and unused.dtype == torch.float32
    assert torch.count_nonzero(unused.full_tensor()) == 0


def _all_cases() -> None:
    for existing_grad in (False, True):
        _to_bfloat16(existing_grad)
    for reduce_dtype in (torch.bfloat16, torch.float32):
        _summed_in(reduce_dtype)
    _same_dtype_keeps_parameters()
    _policy_fields()


@pytest.mark.slow
def test_dtype_conversion_after_sharding_is_a_plain_modules():
    run_distributed(_all_cases, 2)
