"""Tensor-subclass parameters that choose their own all-gather
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), as torch's FSDP2 tests check them
(test_fully_shard_extensions.py), in our own words:

- parameters of torch's test subclass ``TwoTensor`` gather both inner tensors and train
  as a single-process copy does, with the one-argument hook (``mesh``) and the
  five-argument one (``mesh, outer_size, outer_stride, module, mp_policy``),
  ``reshard_after_forward`` True and False;
- the same model built on the meta device, sharded with a bf16 ``param_dtype``,
  materialized with ``to_empty`` and initialized in place, trains;
- a subclass that sends its shard in bf16 and pads it itself to the padded shard size
  (``outer_size`` says the unsharded size; dim 0 of 3 rows over 2 ranks leaves one rank
  short) gathers its values rounded to bf16 and trains with fused AdamW.

Not here (docs/conformance.md): hooks set on a parameter's local tensor object after
sharding (torch's "monkey patch" test) and a 2-D (replicate, shard) mesh, which
fullshard refuses for subclass parameters (docs/errors.md E106).

All cases run in one launch of two ranks.
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.testing._internal.two_tensor import TwoTensor

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.testing import run_distributed

DIM = 8


# -- TwoTensor: every op runs on both inner tensors; the gather sends both --------------
def _pre_gather_mesh_only(self, mesh):
    return (self.a, self.b), None


def _pre_gather_full(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.a, self.b), None


def _post_gather(self, outputs, metadata, param_dtype, *, out=None):
    a, b = outputs
    if out is not None:  # a later gather refilled the outputs the tensor already views
        if a.dtype != param_dtype:
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


@contextlib.contextmanager
def _two_tensor_gathers(pre_gather):
    # Each rank is a process of its own: setting the hooks on the class touches no one else.
    TwoTensor.fsdp_pre_all_gather = pre_gather
    TwoTensor.fsdp_post_all_gather = _post_gather
    try:
        yield
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


def _mlp(hidden: int = DIM) -> nn.Sequential:
    # no biases: a plain parameter's gradient on the reference would be a TwoTensor
    return nn.Sequential(nn.Linear(DIM, hidden, bias=False), nn.ReLU(),
                         nn.Linear(hidden, DIM, bias=False))


def _two_tensor_model() -> nn.Sequential:
    model = nn.Sequential(*[_mlp(2 * DIM) for _ in range(3)])
    for mlp in model:
        for i in (0, 2):
            w = mlp[i].weight
            mlp[i].weight = nn.Parameter(TwoTensor(w.detach(), w.detach().clone()))
    return model


def _same_shards(model: nn.Module, master: nn.Module, what: str, grads: bool) -> None:
    """Each rank's shard of every parameter (both inner tensors) equals its rows of the
    reference's; its gradient, a plain tensor (the reduction sends the gradient's data:
    torch's FSDP2 reduces the same), equals the reference gradient's inner tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for (name, p), ref in zip(model.named_parameters(), master.parameters()):
        rows = torch.chunk(ref, world)[rank]
        for part in ("a", "b"):
            assert torch.equal(getattr(p.to_local(), part), getattr(rows, part)), \
                f"{what}: {name}.{part}"
        if grads:
            grad, ref_rows = p.grad.to_local(), torch.chunk(ref.grad, world)[rank]
            assert type(grad) is torch.Tensor, f"{what}: {name}.grad is {type(grad).__name__}"
            assert torch.equal(grad, ref_rows.a) and torch.equal(grad, ref_rows.b), \
                f"{what}: gradient of {name}"


def _two_tensor_training(pre_gather, reshard_after_forward: bool) -> None:
    what = f"TwoTensor, {pre_gather.__name__}, reshard {reshard_after_forward}"
    world = dist.get_world_size()
    with _two_tensor_gathers(pre_gather):
        torch.manual_seed(42)
        model = _two_tensor_model()
        master = copy.deepcopy(model)
        for mlp in model:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_optim = torch.optim.Adam(master.parameters(), lr=1e-2)
        _same_shards(model, master, what, grads=False)
        x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
        for step in range(4):
            loss, ref_loss = model(x).sum(), master(x).sum()
            loss.backward()
            ref_loss.backward()
            for p in master.parameters():  # the ranks' mean, summed then divided
                for part in (p.grad.a, p.grad.b):
                    dist.all_reduce(part)
                    part.div_(world)
            assert torch.equal(loss.a, ref_loss.a) and torch.equal(loss.b, ref_loss.b), what
            _same_shards(model, master, f"{what}, step {step}", grads=True)
            for opt in (optim, ref_optim):
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 0)
        _same_shards(model, master, f"{what}, after the steps", grads=False)


def _meta_init_with_bf16_compute(reshard_after_forward: bool) -> None:
    with _two_tensor_gathers(_pre_gather_full):
        with torch.device("meta"):
            model = _two_tensor_model()
        assert all(p.device.type == "meta" for p in model.parameters())
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for mlp in model:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.trunc_normal_(p)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randn(2, DIM)
        for _ in range(3):
            out = model(x)
            assert out.a.dtype == torch.bfloat16
            out.sum().backward()
            optim.step()
            optim.zero_grad()
        assert all(torch.isfinite(p.to_local().a).all() for p in model.parameters())


# -- a subclass that sends its shard in bf16, padding it itself -------------------------
class _SentInBf16(torch.Tensor):
    """Holds an fp32 tensor; its all-gather sends the shard rounded to bf16, padded to
    the padded shard size by the subclass (the rule for uneven shards)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, data.stride(), data.storage_offset(), dtype=data.dtype,
            device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        out = func(*pytree.tree_map_only(cls, lambda t: t._data, args),
                   **pytree.tree_map_only(cls, lambda t: t._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return _SentInBf16(inner["_data"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = math.ceil(outer_size[0] / mesh.size())
        sent = torch.zeros(rows, *outer_size[1:], dtype=torch.bfloat16)
        sent[: self._data.shape[0]].copy_(self._data)
        return (sent,), None

    @torch.no_grad()  # refilling ``out``, a leaf that requires grad (so does torch's)
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        assert gathered.dtype == torch.bfloat16
        if out is not None:
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.shape[0]])  # the outputs hold the padded rows
            return None
        whole = gathered.to(param_dtype)
        return whole, (gathered, whole)


def _pads_its_own_shard() -> None:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(3, 9), nn.ReLU(), nn.Linear(9, 3))
    master = copy.deepcopy(model)
    for module in (model[0], model[2]):
        module.weight = nn.Parameter(_SentInBf16(module.weight.detach()))
    fully_shard(model, reshard_after_forward=False)
    assert dist.get_world_size() == 2 and model[2].weight.shape[0] == 3  # one rank short
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():  # the weights as the gather delivers them: rounded to bf16
        for module in (master[0], master[2]):
            module.weight.copy_(module.weight.bfloat16().float())
    torch.testing.assert_close(model(x), master(x), rtol=0, atol=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(x).sum().backward()
    optim.step()
    optim.zero_grad()
    model(x).sum().backward()  # the next gather sends the stepped shard


def _all_cases() -> None:
    for pre_gather in (_pre_gather_mesh_only, _pre_gather_full):
        for reshard in (True, False):
            _two_tensor_training(pre_gather, reshard)
    for reshard in (True, False):
        _meta_init_with_bf16_compute(reshard)
    _pads_its_own_shard()


@pytest.mark.slow
def test_subclass_parameters_gather_through_their_hooks_as_in_torchs_fsdp2():
    run_distributed(_all_cases, 2)
