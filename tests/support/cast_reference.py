"""A single-process model that does a sharded model's mixed-precision arithmetic by hand,
and a recorder of the dtypes gradients are reduced in, for the conformance tests of
torch's FSDP2 mixed precision (tests/conformance/test_fsdp2_mixed_precision*.py).

The reference runs on each rank, on that rank's own rows, as the sharded model does:
fp32 master weights, a copy in ``param_dtype`` for forward and backward, its gradients
cast to ``reduce_dtype``, averaged over the ranks in that dtype, cast back to fp32 for
the optimizer. At two ranks a sum has one order and halving is exact, so the reference's
reduction is the sharded model's to the bit, whatever order of division an
implementation picks: losses, gradients and weights are compared exactly.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard.torch_version import REDUCE_IN_GRAD_DTYPE

# The collectives that reduce: torch's FSDP2 reduce-scatters (``reduce_scatter_single``
# from torch 2.13, ``reduce_scatter_tensor`` before), fullshard's gloo path all-to-alls
# then sums (Note [reduce-scatter on gloo]), HSDP and DDP all-reduce. Both implementations
# look them up on torch.distributed at each call, so a patch sees them.
_REDUCTIONS = ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single",
               "all_reduce")


@contextlib.contextmanager
def reduction_dtypes():
    """Yield a list that gathers the dtype of every floating-point reduction issued inside
    the block (integer ones are an implementation's bookkeeping, not gradients)."""
    seen: list[torch.dtype] = []
    originals = {name: getattr(dist, name) for name in _REDUCTIONS if hasattr(dist, name)}

    def recording(real):
        def call(*args, **kwargs):
            # the output (or the reduced tensor), by position or by name
            tensor = args[0] if args else next(
                kwargs[k] for k in ("output", "output_tensor", "tensor") if k in kwargs)
            if tensor.is_floating_point():
                seen.append(tensor.dtype)
            return real(*args, **kwargs)
        return call

    for name, real in originals.items():
        setattr(dist, name, recording(real))
    try:
        yield seen
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)


def _reduced(grad: torch.Tensor, reduce_dtype: torch.dtype) -> torch.Tensor:
    """The ranks' average of ``grad``, summed in ``reduce_dtype`` (gathered in fp32 or
    wider, which holds every bf16 and fp16 value exactly, so only the sum rounds). In
    fp16 each part is divided by a power of two near the square root of the world size
    before the sum and the sum by the rest after, as torch's FSDP2 reduces fp16."""
    world = dist.get_world_size()
    wide = torch.promote_types(grad.dtype, torch.float32)
    parts = [torch.empty_like(grad, dtype=wide) for _ in range(world)]
    dist.all_gather(parts, grad.to(wide).contiguous())
    before = 1
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        while world % before == 0 and world / before > before:
            before *= 2
    total = parts[0].to(reduce_dtype) / before
    for part in parts[1:]:
        total = total + part.to(reduce_dtype) / before
    return total / (world / before)


class CastReference:
    """``master`` weights (fp32, or the model's dtype) stepped by Adam; forward and backward in a
    ``param_dtype`` copy (the master itself when None); gradients reduced in
    ``reduce_dtype`` (default, as the installed torch's FSDP2: the compute dtype before
    torch 2.15, the parameters' fp32 from it, Note [torch versions])."""

    def __init__(self, master: nn.Module, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, lr: float = 1e-2):
        self.master = master
        self.compute = master if param_dtype is None else copy.deepcopy(master).to(param_dtype)
        master_dtype = next(master.parameters()).dtype
        self.param_dtype = param_dtype or master_dtype
        self.reduce_dtype = reduce_dtype or (master_dtype if REDUCE_IN_GRAD_DTYPE
                                             else self.param_dtype)
        self.optim = torch.optim.Adam(master.parameters(), lr=lr, foreach=False)

    def forward_backward(self, loss_of) -> torch.Tensor:
        """Backward of ``loss_of(compute model)``; the compute gradients are added to
        the master's in fp32 (unreduced: ``reduce`` averages them over the ranks)."""
        loss = loss_of(self.compute)
        loss.backward()
        for p, c in zip(self.master.parameters(), self.compute.parameters()):
            if c is p:
                continue
            grad = c.grad.to(p.dtype)
            p.grad = grad if p.grad is None else p.grad + grad
            c.grad = None
        return loss.detach()

    def reduce(self) -> None:
        for p in self.master.parameters():
            if p.grad is not None:  # the same on every rank: the same modules ran
                p.grad = _reduced(p.grad, self.reduce_dtype).to(p.dtype)

    def step(self, set_to_none: bool) -> None:
        self.optim.step()
        self.optim.zero_grad(set_to_none=set_to_none)
        if self.compute is not self.master:
            with torch.no_grad():
                for p, c in zip(self.master.parameters(), self.compute.parameters()):
                    c.copy_(p)


def assert_same_shards(model: nn.Module, master: nn.Module, what: str, *,
                       grads: bool = True, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Every sharded parameter (and its gradient) equals the reference's: bit for bit
    unless given a tolerance (where the two sum in different orders)."""
    for (name, p), ref in zip(model.named_parameters(), master.parameters()):
        assert p.dtype == ref.dtype, f"{what}: {name} is {p.dtype}, not {ref.dtype}"
        torch.testing.assert_close(p.full_tensor(), ref, rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{what}: parameter {n}: {m}")
        if grads and ref.grad is not None:
            assert p.grad.dtype == ref.grad.dtype, f"{what}: {name}.grad is {p.grad.dtype}"
            torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=rtol, atol=atol,
                                       msg=lambda m, n=name: f"{what}: gradient {n}: {m}")
