"""Mixed-precision training, as torch's FSDP2 tests check it
(test_fully_shard_mixed_precision.py, its training half), in our own words: every
configuration trains exactly as a single-process model that does the same casts by hand
(tests/support/cast_reference.py):

- compute in bf16 or fp16 (gradients reduced in that dtype), bf16 compute with an fp32
  reduction, fp32 compute with a bf16 reduction; each with ``reshard_after_forward``
  False, True and 2, and parameters sharded on dim 0 or on their largest dim;
- the reduction runs in ``reduce_dtype`` and the sharded gradients come back in the
  parameters' dtype;
- a unit whose first forward ran with every parameter frozen still reduces in its
  ``reduce_dtype`` once they train;
- gradients accumulated without reduction (``set_requires_gradient_sync(False)``, with
  and without resharding after backward) accumulate in fp32 under bf16 compute;
- activations between units inside dataclasses, nested dataclasses and namedtuples;
- a forward-mode product (``torch.func.jvp``) through units that keep their parameters
  gathered, first run with no warm-up.

Losses, gradients and weights are compared bit for bit: at two ranks the reference's
arithmetic is the sharded model's. All cases of a test run in one launch of two ranks.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from support.cast_reference import CastReference, assert_same_shards, reduction_dtypes
from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.testing import run_distributed

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DIM = 16


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.ndim), key=lambda d: param.shape[d]))


def _sharded_mlps(reshard_after_forward, policy, largest_dim: bool):
    """Three MLP units under a root unit, and an fp32 copy of them for the reference."""
    torch.manual_seed(42)
    model = nn.Sequential(*[_MLP() for _ in range(3)])
    master = copy.deepcopy(model)
    kwargs = {"reshard_after_forward": reshard_after_forward, "mp_policy": policy}
    if largest_dim:
        kwargs["shard_placement_fn"] = _largest_dim
    for mlp in model:
        fully_shard(mlp, **kwargs)
    fully_shard(model, **kwargs)
    return model, master


def _train(param_dtype, reduce_dtype, reshard_after_forward, largest_dim: bool) -> None:
    what = (f"param {param_dtype}, reduce {reduce_dtype}, reshard {reshard_after_forward}, "
            f"{'largest dim' if largest_dim else 'dim 0'}")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model, master = _sharded_mlps(reshard_after_forward, policy, largest_dim)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, param_dtype, reduce_dtype)
    compute = param_dtype or FP32
    torch.manual_seed(43 + torch.distributed.get_rank())  # each rank its own rows
    x = torch.randn(4, DIM)
    for step in range(4):
        loss = model(x).sum()
        assert loss.dtype == compute, f"{what}: loss in {loss.dtype}"
        with reduction_dtypes() as reduced_in:
            loss.backward()
        assert set(reduced_in) == {reference.reduce_dtype}, f"{what}: reduced in {reduced_in}"
        ref_loss = reference.forward_backward(lambda m: m(x.to(compute)).sum())
        reference.reduce()
        assert torch.equal(loss.detach(), ref_loss), f"{what}, step {step}: {loss} != {ref_loss}"
        assert_same_shards(model, master, f"{what}, step {step}")
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        reference.step(set_to_none=step % 2 == 0)
        assert_same_shards(model, master, f"{what}, after step {step}", grads=False)


def _dtype_combinations() -> None:
    for reshard in (False, True, 2):
        for largest_dim in (False, True):
            for param_dtype, reduce_dtype in ((BF16, None), (FP16, None), (BF16, FP32),
                                              (None, BF16)):
                _train(param_dtype, reduce_dtype, reshard, largest_dim)


@pytest.mark.slow
def test_each_dtype_combination_trains_as_a_reference_with_the_same_casts():
    run_distributed(_dtype_combinations, 2)


class _FrozenFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))

    def forward(self, x):
        return self.layers(x)


def _reduce_dtype_after_frozen_first_forward() -> None:
    model = _FrozenFirst()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32))
    model.requires_grad_(False)
    x = torch.randn(4, DIM)
    with torch.no_grad():
        model(x)
    model.layers.requires_grad_(True)
    with reduction_dtypes() as reduced_in:
        model(x).sum().backward()
    assert reduced_in and set(reduced_in) == {FP32}, reduced_in
    assert all(p.grad.dtype == FP32 for p in model.parameters())


def _accumulate(reshard_after_forward: bool) -> None:
    """Four micro-batches per step, reduced on the last only; the unit reshards after
    backward on the last one or when it reshards after forward."""
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    model, master = _sharded_mlps(reshard_after_forward, policy, largest_dim=False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, BF16, FP32)
    torch.manual_seed(43 + torch.distributed.get_rank())
    rows = torch.randn(8, DIM, dtype=BF16)
    for step in range(3):
        for micro, x in enumerate(rows.chunk(4)):
            last = micro == 3
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last or reshard_after_forward)
            loss = model(x).sum()
            with reduction_dtypes() as reduced_in:
                loss.backward()
            assert set(reduced_in) == ({FP32} if last else set()), (micro, reduced_in)
            ref_loss = reference.forward_backward(lambda m: m(x).sum())
            assert loss.dtype == BF16 and torch.equal(loss.detach(), ref_loss), (step, micro)
        reference.reduce()
        assert_same_shards(model, master, f"accumulated, reshard {reshard_after_forward}, "
                                          f"step {step}")
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        reference.step(set_to_none=step % 2 == 0)


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class _Nested:
    inner: _Pair
    z: torch.Tensor


class _Tuple(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class _Wrap(nn.Module):
    """Turns a tensor into the container ``kind`` (each field its own autograd path)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind is _Nested:
            return _Nested(_Pair(x, x.clone()), x.clone())
        return self.kind(x, x.clone())


class _PerField(nn.Module):
    """One linear layer applied to every tensor of the container."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, c: Any):
        if isinstance(c, _Nested):
            return _Nested(_Pair(self.lin(c.inner.x), self.lin(c.inner.y)), self.lin(c.z))
        return type(c)(self.lin(c.x), self.lin(c.y))


class _Unwrap(nn.Module):
    def forward(self, c: Any):
        return c.inner.x + c.inner.y + c.z if isinstance(c, _Nested) else c.x + c.y


def _structured(kind, param_dtype, reduce_dtype) -> None:
    what = f"{kind.__name__}, param {param_dtype}, reduce {reduce_dtype}"
    torch.manual_seed(42)
    model = nn.Sequential(_Wrap(kind), _PerField(), _PerField(), _Unwrap())
    master = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in model:
        fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, param_dtype, reduce_dtype)
    for step in range(3):
        torch.manual_seed(100 * step + torch.distributed.get_rank())
        x = torch.rand(2, DIM)
        loss = model(x).sum()
        loss.backward()
        ref_loss = reference.forward_backward(lambda m: m(x.to(param_dtype or FP32)).sum())
        reference.reduce()
        assert torch.equal(loss.detach(), ref_loss), f"{what}, step {step}"
        assert_same_shards(model, master, f"{what}, step {step}")
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        reference.step(set_to_none=step % 2 == 0)


def _jvp_without_warm_up() -> None:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=True)
    with torch.device("meta"):
        encoder = nn.Linear(32, 64, bias=False)
        decoder = nn.Linear(64, 80, bias=False)
    for module in (encoder, decoder):
        fully_shard(module, mp_policy=policy, reshard_after_forward=False)
    for seed, module in enumerate((encoder, decoder)):
        module.to_empty(device="cpu")
        with torch.no_grad():
            module.weight.normal_(std=module.in_features ** -0.5,
                                  generator=torch.Generator().manual_seed(42 + seed))
    x = torch.randn(32, dtype=BF16)
    encoded = encoder(x)
    primal = torch.randn(80, dtype=BF16, requires_grad=True)
    output, tangent = torch.func.jvp(lambda unused: decoder(encoded), (primal,),
                                     (torch.randn(80, dtype=BF16),))
    assert output.shape == (80,) and output.dtype == BF16
    assert torch.equal(tangent, torch.zeros_like(output))  # the output does not use the primal


def _other_cases() -> None:
    _reduce_dtype_after_frozen_first_forward()
    for reshard in (True, False):
        _accumulate(reshard)
    for kind in (_Pair, _Nested, _Tuple):
        for param_dtype, reduce_dtype in ((None, None), (BF16, BF16), (BF16, FP32)):
            _structured(kind, param_dtype, reduce_dtype)
    _jvp_without_warm_up()


@pytest.mark.slow
def test_frozen_first_forward_accumulation_containers_and_jvp_as_in_torchs_fsdp2():
    run_distributed(_other_cases, 2)
