"""A parameter's own ``grad_dtype`` (Note [a parameter's grad_dtype]), followed as torch
2.15's FSDP2 follows it: the same model sharded by fullshard and by torch's ``fully_shard``
side by side, the same rows on each rank, and after every backward the sharded gradients'
dtypes and values must be equal bit for bit, then an SGD step on each (a few steps). Cases:
bf16 parameters accumulating fp32 gradients, with and without a ``MixedPrecisionPolicy``
(an fp32 or bf16 ``reduce_dtype``, or fp32 parameters computing in bf16 whose gradient is
narrowed to bf16), ``grad_dtype=None``, a ``grad_dtype`` set on the sharded parameter
after ``fully_shard``, an explicit ``grad_dtype`` kept through ``model.to(torch.bfloat16)``
after ``fully_shard``, and microbatches accumulated without gradient sync. torch 2.15 only:
before it torch's FSDP2 ignores the attribute, and so does fullshard (the last test)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.testing import run_distributed
from fullshard.torch_version import FOLLOWS_PARAM_GRAD_DTYPE
from support.catalogue import matches_documented, message_of

needs_215 = pytest.mark.skipif(not FOLLOWS_PARAM_GRAD_DTYPE,
                               reason="torch's FSDP2 follows grad_dtype from torch 2.15")

# case: (parameter dtype, {parameter name: grad_dtype}, policy fields, set after sharding,
#        microbatches per step without sync before the synced one); "twice" in the name:
#        the first layer runs twice per forward (autograd adds its gradients up); "to(bf16)"
#        in the name: the sharded model is converted to bf16 before training
CASES = {
    "fp32 grads of bf16 params": (torch.bfloat16, {"0.weight": torch.float32,
                                                   "2.bias": torch.float32}, {}, False, 0),
    "fp32 grads, bf16 reduce": (torch.bfloat16, {"0.weight": torch.float32},
                                {"reduce_dtype": torch.bfloat16}, False, 0),
    "fp32 grads, fp32 reduce": (torch.bfloat16, {"2.weight": torch.float32},
                                {"reduce_dtype": torch.float32}, False, 0),
    "bf16 grads of fp32 params computing in bf16": (
        torch.float32, {"0.weight": torch.bfloat16}, {"param_dtype": torch.bfloat16}, False, 0),
    "grad_dtype None, bf16 compute": (torch.float32, {"0.weight": None, "0.bias": None},
                                      {"param_dtype": torch.bfloat16}, False, 0),
    "set after sharding": (torch.bfloat16, {"0.weight": torch.float32}, {}, True, 0),
    "accumulated without sync": (torch.bfloat16, {"0.weight": torch.float32,
                                                  "0.bias": torch.float32}, {}, False, 1),
    "accumulated without sync, bf16 compute": (
        torch.float32, {"2.weight": torch.bfloat16}, {"param_dtype": torch.bfloat16}, False, 1),
    "bf16 grads of fp32 params used twice": (torch.float32, {"0.weight": torch.bfloat16},
                                             {}, False, 0),
    "an explicit fp32 kept through to(bf16) after sharding": (
        torch.float32, {"0.weight": torch.float32}, {}, False, 0),
    "bf16 grads of fp32 params, without sync": (
        torch.float32, {"0.weight": torch.bfloat16, "2.bias": torch.bfloat16}, {}, False, 2),
}


class _Net(nn.Sequential):
    """Linear, ReLU, Linear; with ``twice`` the first layer runs twice."""

    def __init__(self, twice: bool):
        super().__init__(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self[0](x)
        if self.twice:
            h = self[0](self[1](h))
        return self[2](self[1](h))


def _shard(model: nn.Sequential, impl: str, policy: dict) -> nn.Module:
    if impl == "fullshard":
        shard_fn, policy_cls = fully_shard, MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as policy_cls
        from torch.distributed.fsdp import fully_shard as shard_fn
    mp = policy_cls(**policy)
    for layer in (model[0], model[2]):
        shard_fn(layer, mp_policy=mp)
    return shard_fn(model, mp_policy=mp)


def _grads(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.full_tensor()
            for n, p in model.named_parameters()}


def _side_by_side(case: str, steps: int = 3) -> list:
    """Each backward's gradients (name -> (dtype, values)) of both implementations."""
    dtype, grad_dtypes, policy, after, no_sync = CASES[case]
    torch.manual_seed(0)
    base = _Net("twice" in case).to(dtype)
    models = []
    for impl in ("fullshard", "torch"):
        model = copy.deepcopy(base)
        named = dict(model.named_parameters())
        if not after:
            for name, grad_dtype in grad_dtypes.items():
                named[name].grad_dtype = grad_dtype
        model = _shard(model, impl, policy)
        if after:
            named = dict(model.named_parameters())
            for name, grad_dtype in grad_dtypes.items():
                named[name].grad_dtype = grad_dtype
        if "to(bf16)" in case:
            model.to(torch.bfloat16)
        models.append(model)
    if "to(bf16)" in case:
        dtype = torch.bfloat16
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    seen = []
    for step in range(steps):
        for micro in range(no_sync + 1):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + dist.get_rank())
            x = torch.randn(4, 8, generator=g)
            for model in models:
                model.set_requires_gradient_sync(micro == no_sync)
                model(x.to(dtype)).float().pow(2).sum().backward()
        ours, theirs = (_grads(m) for m in models)
        for name, want in theirs.items():
            got = ours[name]
            assert (got is None) == (want is None), (case, step, name)
            if want is not None:
                assert got.dtype == want.dtype, (case, step, name, got.dtype, want.dtype)
                assert torch.equal(got, want), (case, step, name, (got - want).abs().max())
        seen.append({n: None if t is None else t.dtype for n, t in theirs.items()})
        for optim in optims:
            optim.step()
            optim.zero_grad()
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a.full_tensor(), b.full_tensor()), case
    return seen


def _all_cases() -> dict:
    return {case: _side_by_side(case) for case in CASES}


@needs_215
@pytest.mark.slow  # a launch of its own per world size
@pytest.mark.parametrize("world", [1, 2])
def test_gradients_follow_grad_dtype_as_torch_fully_shard_does(world):
    seen = run_distributed(_all_cases, world)[0]
    # what torch hands out, which fullshard matched bit for bit above
    assert seen["fp32 grads of bf16 params"][0] == {
        "0.weight": torch.float32, "0.bias": torch.bfloat16,
        "2.weight": torch.bfloat16, "2.bias": torch.float32}
    assert seen["fp32 grads, bf16 reduce"][0]["0.weight"] == torch.float32
    assert seen["bf16 grads of fp32 params computing in bf16"][0]["0.weight"] == torch.bfloat16
    assert seen["bf16 grads of fp32 params computing in bf16"][0]["0.bias"] == torch.float32
    assert seen["set after sharding"][0]["0.weight"] == torch.float32
    assert seen["grad_dtype None, bf16 compute"][0]["0.weight"] == torch.bfloat16
    converted = seen["an explicit fp32 kept through to(bf16) after sharding"][0]
    assert (converted["0.weight"], converted["0.bias"]) == (torch.float32, torch.bfloat16)
    assert seen["accumulated without sync"][-1]["0.bias"] == torch.float32


def _unused_as_zeros(impl: str) -> str:
    model = nn.Linear(4, 4, dtype=torch.bfloat16)
    model.weight.grad_dtype = None
    model = _shard(nn.Sequential(model, nn.ReLU(), nn.Linear(4, 4, dtype=torch.bfloat16)),
                   impl, {})
    model.set_reduce_scatter_unused_params(True)
    return message_of(lambda: model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward())


def _refusals() -> dict:
    return {impl: _unused_as_zeros(impl) for impl in ("fullshard", "torch")}


@needs_215
@pytest.mark.slow
def test_grad_dtype_none_with_unused_params_as_zeros_is_refused_as_torch_refuses_it():
    seen = run_distributed(_refusals, 1)[0]
    assert seen["torch"].startswith("ValueError: Reducing unused parameters with "
                                    "grad_dtype=None"), seen
    assert matches_documented("E363", seen["fullshard"]), seen
    assert seen["fullshard"].startswith(seen["torch"].split(":")[0]), seen


def _kept_dtype() -> str:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model[1].weight.grad_dtype = torch.float64
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        param_dtype_override_fn=lambda p: torch.float32 if p.ndim == 1 else None)
    fully_shard(model, mp_policy=policy)
    return message_of(lambda: model(torch.ones(2, 4)).sum().backward())


@needs_215
@pytest.mark.slow
def test_grad_dtype_on_a_parameter_gathered_beside_the_flat_buffers_is_refused():
    seen = run_distributed(_kept_dtype, 1)[0]
    assert matches_documented("E362", seen), seen


def _before_215() -> dict:
    def train(grad_dtype):
        linear = nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
        linear.weight.grad_dtype = grad_dtype
        model = fully_shard(linear)
        model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
        return model.weight.grad.dtype

    def after_sharding():
        model = fully_shard(nn.Linear(4, 4, bias=False, dtype=torch.bfloat16))
        model.weight.grad_dtype = torch.float32
        model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    return {"fp32": train(torch.float32), "any": train(None),
            "after": message_of(after_sharding)}


@pytest.mark.skipif(FOLLOWS_PARAM_GRAD_DTYPE, reason="torch 2.15 follows grad_dtype")
@pytest.mark.slow
def test_before_torch_215_grad_dtype_is_ignored_as_torch_fully_shard_ignores_it():
    seen = run_distributed(_before_215, 1)[0]
    assert seen["fp32"] == seen["any"] == torch.bfloat16, seen
    # set on the sharded parameter, autograd refuses the gradient as under torch's FSDP2
    assert seen["after"].startswith("RuntimeError: attempting to assign a gradient "
                                    "with dtype 'c10::BFloat16'"), seen["after"]
