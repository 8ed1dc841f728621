"""A parameter's own ``grad_dtype`` (Note [a parameter's grad_dtype]): from torch 2.15,
whose FSDP2 returns and reduces the gradient in it, a ``grad_dtype`` other than the
parameter's dtype is refused by name, set before ``fully_shard`` or on the sharded
parameter before the first forward; before 2.15 torch's FSDP2 ignores it, and fullshard
gives the gradients torch does (in the parameter's dtype), and fails where torch fails
(a ``grad_dtype`` set on the sharded parameter: autograd refuses the gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.testing import run_distributed
from fullshard.torch_version import FOLLOWS_PARAM_GRAD_DTYPE
from support.catalogue import matches_documented, message_of


def _bf16_linear(grad_dtype) -> nn.Linear:
    linear = nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
    if grad_dtype != "unset":
        linear.weight.grad_dtype = grad_dtype
    return linear


def _before_sharding(grad_dtype) -> str:
    def train():
        model = fully_shard(_bf16_linear(grad_dtype))
        model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
        assert model.weight.grad.dtype == torch.bfloat16  # torch before 2.15 does the same
    return message_of(train)


def _after_sharding() -> str:
    def train():
        model = fully_shard(_bf16_linear("unset"))
        model.weight.grad_dtype = torch.float32
        model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    return message_of(train)


def _cases() -> dict:
    return {"fp32": _before_sharding(torch.float32), "any": _before_sharding(None),
            "own": _before_sharding(torch.bfloat16), "unset": _before_sharding("unset"),
            "after": _after_sharding()}


@pytest.mark.slow  # a launch of its own; make test-fast has no time left for it
def test_a_grad_dtype_torch_would_follow_is_refused_naming_the_parameter():
    seen = run_distributed(_cases, 1)[0]
    assert seen["own"] == seen["unset"] == "NO ERROR RAISED", seen
    for case in ("fp32", "any", "after"):
        if FOLLOWS_PARAM_GRAD_DTYPE:
            assert matches_documented("E338", seen[case]), (case, seen[case])
    if not FOLLOWS_PARAM_GRAD_DTYPE:
        assert seen["fp32"] == seen["any"] == "NO ERROR RAISED", seen
        # set on the sharded parameter, autograd refuses the gradient as under torch's FSDP2
        assert seen["after"].startswith("RuntimeError: attempting to assign a gradient "
                                        "with dtype 'c10::BFloat16'"), seen["after"]
