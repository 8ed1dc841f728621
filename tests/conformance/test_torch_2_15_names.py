"""What torch 2.15 added to FSDP2, on every supported torch (Note [torch versions]):
manual backward finalization (``set_manual_backward_finalization``, ``finalize_backward``,
``GradientReductionHandle``), ``set_keep_unsharded_storage`` and
``MixedPrecisionPolicy.param_dtype_override_fn``. Each is checked against single-process
training; where the installed torch has it, against torch's FSDP2 too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard.testing import run_distributed

D = 16


class RMSNorm(nn.Module):
    """Llama's: computes in fp32 and multiplies by its weight, whatever the weight's dtype."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D, bias=False)
        self.norm = RMSNorm(D)

    def forward(self, x):
        return self.norm(torch.relu(self.linear(x)))


class Stack(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, D, generator=torch.Generator().manual_seed(10 * step + rank))


def _shard(model: nn.Module, fully_shard, **kwargs) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _reference_grads(model: nn.Module, micro_batches: list[int]) -> dict[str, torch.Tensor]:
    """One process: the gradient of the mean over ranks of each rank's loss, summed over
    micro-batches (what accumulation then one reduction gives)."""
    world = dist.get_world_size()
    for step in micro_batches:
        loss = sum(model(_batch(step, r)).pow(2).mean() for r in range(world)) / world
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# -- manual backward finalization -----------------------------------------------------------
def _manual_finalization(async_op: bool) -> bool:
    from fullshard import GradientReductionHandle, fully_shard

    torch.manual_seed(0)
    reference = Stack()
    model = _shard(copy.deepcopy(reference), fully_shard)
    model.set_manual_backward_finalization(True)
    rank = dist.get_rank()
    for step in range(2):  # two logical backwards of two passes each
        model.set_requires_gradient_sync(False)
        model(_batch(2 * step, rank)).pow(2).mean().backward()
        model.set_requires_gradient_sync(True)
        model(_batch(2 * step + 1, rank)).pow(2).mean().backward()
        handle = model.finalize_backward(async_op=async_op)
        if async_op:
            assert isinstance(handle, GradientReductionHandle)
            handle.wait()
        else:
            assert handle is None
        expected = _reference_grads(reference, [2 * step, 2 * step + 1])
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), expected[name], rtol=1e-5,
                                       atol=1e-6)
        model.zero_grad()
        reference.zero_grad()
    return True


@pytest.mark.parametrize("async_op", [False, True], ids=["wait", "handle"])
def test_manual_backward_finalization_reduces_several_passes_once(async_op):
    assert run_distributed(_manual_finalization, 2, async_op) == [True, True]


def _finalization_misuse() -> list[str]:
    from fullshard import fully_shard

    torch.manual_seed(0)
    model = _shard(Stack(), fully_shard)
    assert model.finalize_backward() is None  # before the first forward: nothing to do
    model(_batch(0, 0)).sum().backward()
    errors = []
    for call in (lambda: model.blocks[0].set_manual_backward_finalization(True),
                 lambda: model.blocks[0].finalize_backward(),
                 lambda: model.set_manual_backward_finalization(1)):
        with pytest.raises((RuntimeError, TypeError)) as err:
            call()
        errors.append(f"{type(err.value).__name__}: {err.value}")
    model.set_manual_backward_finalization(True)
    model(_batch(1, 0)).sum().backward()
    pending = model.finalize_backward(async_op=True)
    with pytest.raises(RuntimeError, match="must be waited on"):
        model.finalize_backward()
    model.reset_iter_state()  # drops the iteration's gradients, and so the handle
    with pytest.raises(RuntimeError, match="invalidated by reset_iter_state"):
        pending.wait()
    return errors


def test_manual_finalization_misuse_is_refused():
    errors = run_distributed(_finalization_misuse, 2)[0]
    assert errors == [
        "RuntimeError: set_manual_backward_finalization must be called on the root module, "
        "not blocks.0",
        "RuntimeError: finalize_backward must be called on the root module, not blocks.0",
        "TypeError: set_manual_backward_finalization: expected a bool, got int"]


# -- set_keep_unsharded_storage --------------------------------------------------------------
def _keep_storage(keep: bool) -> dict:
    from fullshard import fully_shard

    torch.manual_seed(0)
    reference = Stack()
    model = _shard(copy.deepcopy(reference), fully_shard)
    model.set_keep_unsharded_storage(keep)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    addresses = []
    seen = lambda module, _args: addresses.append(module.linear.weight.data_ptr())  # noqa: E731
    model.blocks[1].register_forward_pre_hook(seen)
    rank = dist.get_rank()
    for step in range(3):
        model(_batch(step, rank)).pow(2).mean().backward()
        _reference_grads(reference, [step])
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
    held = model.blocks[1]._unit.group.unsharded.tensor.untyped_storage().nbytes()
    return {"same_addresses": len(set(addresses[1:])) == 1, "held_after_step": held}


def test_keep_unsharded_storage_keeps_the_gathered_addresses():
    kept = run_distributed(_keep_storage, 2, True)[0]
    freed = run_distributed(_keep_storage, 2, False)[0]
    assert kept["same_addresses"] and kept["held_after_step"] > 0
    assert freed["held_after_step"] == 0


# -- param_dtype_override_fn ------------------------------------------------------------------
def _keep_norms_fp32(param: nn.Parameter) -> torch.dtype | None:
    return torch.float32 if param.dim() == 1 else None


def _override(impl: str) -> dict:
    import fullshard

    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        MixedPrecisionPolicy, fully_shard = fullshard.MixedPrecisionPolicy, fullshard.fully_shard
    torch.manual_seed(0)
    model = _shard(Stack(), fully_shard, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, param_dtype_override_fn=_keep_norms_fp32))
    dtypes = {}
    model.blocks[0].register_forward_pre_hook(lambda m, _a: dtypes.update(
        linear=m.linear.weight.dtype, norm=m.norm.weight.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(4):
        loss = model(_batch(step, dist.get_rank())).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"dtypes": dtypes, "losses": losses,
            "weights": [p.full_tensor() for p in model.parameters()]}


def _emulated_reference(world: int) -> list[list[float]]:
    """One process: linear weights computed in bf16 (inputs cast at each block, as
    fully_shard casts them), norm weights in fp32, fp32 master weights and gradients."""
    torch.manual_seed(0)
    master = Stack()
    opt = torch.optim.SGD(master.parameters(), lr=0.1)
    losses = []
    for step in range(4):
        low = copy.deepcopy(master)
        for block in low.blocks:
            block.linear.to(torch.bfloat16)
        per_rank = []
        for r in range(world):
            x = _batch(step, r)
            for block in low.blocks:
                x = block(x.to(torch.bfloat16))
            per_rank.append(x.pow(2).mean())
        (sum(per_rank) / world).backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
        opt.step()
        opt.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return losses


def test_param_dtype_override_keeps_chosen_parameters_in_their_dtype():
    ranks = run_distributed(_override, 2, "fullshard")
    assert ranks[0]["dtypes"] == {"linear": torch.bfloat16, "norm": torch.float32}
    expected = _emulated_reference(2)
    for rank, out in enumerate(ranks):
        assert out["losses"] == pytest.approx([e[rank] for e in expected], rel=1e-2)
    if hasattr(torch.distributed.fsdp.MixedPrecisionPolicy, "param_dtype_override_fn"):
        theirs = run_distributed(_override, 2, "torch")  # torch 2.15 and later
        assert theirs[0]["dtypes"] == ranks[0]["dtypes"]
        for mine, torchs in zip(ranks, theirs):
            assert mine["losses"] == pytest.approx(torchs["losses"], rel=1e-3)
        for p, q in zip(ranks[0]["weights"], theirs[0]["weights"]):
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def _override_misuse() -> str:
    from fullshard import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  param_dtype_override_fn=lambda p: torch.float16)
    with pytest.raises(ValueError) as err:
        fully_shard(Block(), mp_policy=policy)
    return str(err.value)


def test_param_dtype_override_that_names_a_third_dtype_is_refused():
    message = run_distributed(_override_misuse, 2)[0]
    assert message == ("fully_shard(Block): param_dtype_override_fn returned torch.float16 "
                       "for parameter 'linear.weight' (torch.float32); it must return None, "
                       "param_dtype (torch.bfloat16) or the parameter's own dtype.")
