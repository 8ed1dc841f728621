"""Where mixed precision casts, as torch's FSDP2 tests check it
(test_fully_shard_mixed_precision.py, its casting half), in our own words:

- a unit's floating-point inputs are cast to its ``param_dtype`` unless
  ``cast_forward_inputs=False``; a parent in fp32 passes fp32 on; ``output_dtype``
  casts a unit's outputs, so the next unit needs no cast;
- a child's policy decides for the inputs it is given: a tensor made inside the parent's
  forward reaches an fp16 child in fp32 when that child does not cast;
- activation checkpointing's recomputation casts the inputs, and the outputs, as the
  first forward did;
- normalization layers with low-precision parameters: LayerNorm trains; buffers are
  never cast (BatchNorm's running statistics stay fp32, which CPU's kernel refuses beside
  bf16/fp16 weights, on both implementations), those the user casts down train; a policy
  with only ``output_dtype`` keeps a BatchNorm in fp32 between low-precision layers;
- ``reduce_dtype`` is taken as given: a model built in bf16, sharded with a bf16
  reduction and then moved to fp32 still reduces in bf16.

torch runs these on threads of one process and an accelerator; here on two CPU ranks
(bf16 and fp16 both compute on CPU), all in one launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from support.cast_reference import reduction_dtypes
from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.testing import run_distributed

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class _Recording(nn.Module):
    """Records the dtype of each input it is called with; casts it to its weight's
    dtype itself when ``casts``."""

    def __init__(self, casts: bool = False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.casts = casts
        self.input_dtypes: list = []

    def forward(self, x):
        self.input_dtypes.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype) if self.casts else x)


class _TwoChildren(nn.Module):
    def __init__(self, casts: bool):
        super().__init__()
        self.c1, self.c2 = _Recording(casts), _Recording(casts)
        self.input_dtypes: list = []

    def forward(self, x):
        self.input_dtypes.append(x.dtype)
        return self.c2(self.c1(x))


def _input_dtypes(child: str, policy: MixedPrecisionPolicy, casts: bool) -> list:
    model = _TwoChildren(casts)
    fully_shard(getattr(model, child), mp_policy=policy)
    fully_shard(model)
    model(torch.zeros(2, 8)).sum().backward()
    return [m.input_dtypes[0] for m in (model, model.c1, model.c2)]


def _fp16_on_one_child() -> None:
    # the second child in fp16: its unit casts its input
    assert _input_dtypes("c2", MixedPrecisionPolicy(param_dtype=FP16), False) == \
        [FP32, FP32, FP16]
    # ... unless told not to, when the module casts for itself
    assert _input_dtypes("c2", MixedPrecisionPolicy(param_dtype=FP16, cast_forward_inputs=False),
                         True) == [FP32, FP32, FP32]
    # the first child in fp16 hands fp32 on through its output_dtype
    assert _input_dtypes("c1", MixedPrecisionPolicy(param_dtype=FP16, output_dtype=FP32),
                         False) == [FP32, FP16, FP32]


class _ExternalInput(nn.Module):
    """Its parent gives it a tensor made inside the parent's forward, never cast by it."""

    def __init__(self, seen: dict):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen = seen

    def forward(self, x, y):
        self.seen["x"], self.seen["y"] = x.dtype, y.dtype
        return self.lin(x)


class _Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen: dict = {}
        self.first = nn.Linear(8, 8)
        self.child = _ExternalInput(self.seen)

    def forward(self, x):
        self.seen["input"] = x.dtype
        return self.child(self.first(x), torch.ones(2, 8))


def _external_inputs(child_casts: bool) -> None:
    model = _Parent()
    fully_shard(model.child, mp_policy=MixedPrecisionPolicy(param_dtype=FP16,
                                                            cast_forward_inputs=child_casts))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=FP16))
    model(torch.zeros(2, 8)).sum().backward()
    assert model.seen == {"input": FP16, "x": FP16, "y": FP16 if child_casts else FP32}, \
        (child_casts, model.seen)


class _CheckpointedLinear(nn.Module):
    def __init__(self, input_dtype: torch.dtype):
        super().__init__()
        self.linear = _Recording()
        self.input_dtype = input_dtype
        self.output_dtypes: list = []

    def _run(self, x):
        out = self.linear(x)
        self.output_dtypes.append(out.dtype)
        return out

    def forward(self, x):
        out = checkpoint(self._run, x.to(self.input_dtype), use_reentrant=False,
                         early_stop=False)
        return out.float().sum()


def _recomputation_casts(what: str) -> None:
    """The recomputed forward casts its input (``input``), or its output
    (``output``), as the first forward did."""
    if what == "input":
        model = _CheckpointedLinear(FP32)
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    else:
        model = _CheckpointedLinear(BF16)
        policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16, output_dtype=FP32,
                                      cast_forward_inputs=False)
    fully_shard(model.linear, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model(torch.randn(8, 8)).backward()
    if what == "input":
        assert model.linear.input_dtypes == [BF16, BF16], model.linear.input_dtypes
    else:
        assert model.output_dtypes == [FP32, FP32], model.output_dtypes


def _shard_each(model: nn.Sequential, policy, middle_policy=None) -> nn.Sequential:
    """Each layer a unit (the middle one with ``middle_policy`` when given), then the root."""
    for i, module in enumerate(model):
        fully_shard(module, mp_policy=middle_policy if i == 1 and middle_policy else policy)
    fully_shard(model, mp_policy=policy)
    return model


def _forward_backward(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> None:
    out = model(x)
    assert out.dtype == dtype, (out.dtype, dtype)
    out.sum().backward()


def _batch_norms(dtype: torch.dtype, cast_buffers: bool = False, norm_policy=None) -> list:
    """(model, input) for a BatchNorm1d and a BatchNorm2d between two layers, each a unit;
    running statistics cast to ``dtype`` by the user when ``cast_buffers``."""
    cases = [(nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 32)),
              torch.randn(4, 32)),
             (nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3)),
              torch.randn(3, 1, 9, 9))]
    for model, _ in cases:
        _shard_each(model, MixedPrecisionPolicy(param_dtype=dtype), norm_policy)
        if cast_buffers:
            model[1].running_mean = model[1].running_mean.to(dtype)
            model[1].running_var = model[1].running_var.to(dtype)
    return cases


def _norm_layers(dtype: torch.dtype) -> None:
    ln = _shard_each(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32)),
                     MixedPrecisionPolicy(param_dtype=dtype))
    _forward_backward(ln, torch.randn(4, 32), dtype)
    # buffers are not cast: the running statistics stay fp32, which CPU's batch norm
    # refuses beside low-precision weights (torch's test, on an accelerator, sees CUDA
    # refuse the 2-D case only)
    for model, x in _batch_norms(dtype):
        try:
            model(x)
            raise AssertionError(f"{dtype} batch norm with fp32 statistics ran")
        except RuntimeError as e:
            assert "expected scalar type" in str(e), e
        assert model[1].running_mean.dtype == model[1].running_var.dtype == FP32
    # statistics the user casts down stay cast, and are updated
    for model, x in _batch_norms(dtype, cast_buffers=True):
        _forward_backward(model, x, dtype)
        assert model[1].running_mean.dtype == dtype
        assert not torch.equal(model[1].running_mean, torch.zeros_like(model[1].running_mean))
    # a batch norm kept in fp32 that hands its output on in the low precision
    for model, x in _batch_norms(dtype, norm_policy=MixedPrecisionPolicy(output_dtype=dtype)):
        _forward_backward(model, x, dtype)
        assert model[1].weight.dtype == model[1].running_mean.dtype == FP32


def _reduce_dtype_is_not_clamped() -> None:
    model = nn.Sequential(nn.Linear(32, 32, dtype=BF16), nn.Linear(32, 32, dtype=BF16))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    assert policy.reduce_dtype == BF16
    _shard_each(model, policy)
    model.to(FP32)
    with reduction_dtypes() as reduced_in:
        model(torch.randn(4, 32)).sum().backward()
    assert reduced_in and set(reduced_in) == {BF16}, reduced_in
    assert all(p.dtype == FP32 and p.grad.dtype == FP32 for p in model.parameters())


def _all_cases() -> None:
    _fp16_on_one_child()
    for child_casts in (False, True):
        _external_inputs(child_casts)
    for what in ("input", "output"):
        _recomputation_casts(what)
    for dtype in (BF16, FP16):
        _norm_layers(dtype)
    _reduce_dtype_is_not_clamped()


@pytest.mark.slow
def test_mixed_precision_casts_where_torchs_fsdp2_does():
    run_distributed(_all_cases, 2)
