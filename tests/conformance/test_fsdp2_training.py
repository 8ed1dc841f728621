"""Training, as torch's FSDP2 tests check it (test_fully_shard_training.py, the
behaviours not yet covered elsewhere in tests/conformance), in our own words:

- a root with no parameters of its own, taking a tuple, and a root whose forward takes
  no inputs at all;
- ``model.to(torch.float64)`` after sharding: parameters, shards and gradients are
  fp64 and train as an fp64 copy;
- one unit, its parameters sharded on dim 0 (evenly or not, ranks holding padding) or
  on their largest dim;
- several units, ``reshard_after_forward`` True, False and 2, and CPU offload;
- a forward and backward through the root, then one through a child unit alone;
- a unit called twice in one forward;
- an embedding tied to the output head (one parameter, two uses in the root unit),
  blocks as units, with and without activation checkpointing on the blocks;
- gradient accumulation: reduction switched off for every unit, for the root's own
  parameters only, or for some units (``set_requires_gradient_sync`` with ``recurse``),
  with and without ``set_reshard_after_backward(False)``, gradients zeroed or set to
  None between steps;
- micro-batches as a 1F1B pipeline stage runs them: units kept gathered after forward,
  optionally all gathered up front (``unshard(async_op=True)``), reduction and
  ``set_is_last_backward`` on the last micro-batch only.

Each case trains beside a single-process copy fed every rank's rows, its gradients
averaged over the ranks (tests/support/cast_reference.py): bit for bit where both sum
in the same order, to fp32 rounding where the sharded model adds gradients averaged
per micro-batch. All cases of a test run in one launch of two ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from support.cast_reference import CastReference, assert_same_shards
from fullshard import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from fullshard.testing import run_distributed

DIM = 16


class _MLP(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _rows(n: int, width: int, dtype=torch.float32) -> torch.Tensor:
    """This rank's own rows (each rank draws different ones)."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    return torch.randn(n, width, generator=g, dtype=dtype)


def _train(model: nn.Module, master: nn.Module, what: str, x: torch.Tensor, steps: int = 3,
           **tolerance) -> None:
    """Adam on both; losses, shards and gradients compared after every backward."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, None, None)
    for step in range(steps):
        loss = model(x).sum()
        loss.backward()
        ref_loss = reference.forward_backward(lambda m: m(x).sum())
        reference.reduce()
        torch.testing.assert_close(loss.detach(), ref_loss, **tolerance or {"rtol": 0, "atol": 0})
        assert_same_shards(model, master, f"{what}, step {step}", **tolerance)
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        reference.step(set_to_none=step % 2 == 0)


class _NoParameters(nn.Module):
    def forward(self, x, ys):
        return x + ys[0] + ys[1] + 1


class _NoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self):
        return self.weight @ self.weight


def _roots_without_parameters_or_inputs() -> None:
    x, ys = torch.randn(3), (torch.randn(3), torch.randn(3))
    out = fully_shard(_NoParameters())(x, ys)
    assert torch.equal(out, x + ys[0] + ys[1] + 1)
    model = fully_shard(_NoInputs())
    out = model()
    assert out.shape == (4, 4)
    out.sum().backward()
    assert isinstance(model.weight.grad, DTensor) and model.weight.grad.shape == (4, 4)


def _to_float64_after_sharding() -> None:
    torch.manual_seed(42)
    model = _MLP(4)
    master = copy.deepcopy(model).to(torch.float64)
    for module in (model.up, model.down, model):
        fully_shard(module)
    model.to(torch.float64)
    for p in model.parameters():
        assert p.dtype == p.to_local().dtype == torch.float64
    _train(model, master, "fp64 after sharding", _rows(2, 4, torch.float64))
    for p in model.parameters():
        assert p.dtype == p.to_local().dtype == torch.float64
    x = _rows(2, 4, torch.float64)
    model(x).sum().backward()
    assert all(p.grad.dtype == p.grad.to_local().dtype == torch.float64
               for p in model.parameters())


def _one_unit(shapes, largest_dim: bool) -> None:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1]))
    master = copy.deepcopy(model)
    placement = (lambda p: Shard(p.shape.index(max(p.shape)))) if largest_dim else None
    fully_shard(model, shard_placement_fn=placement)
    _train(model, master, f"one unit {shapes}, largest dim {largest_dim}",
           _rows(4, shapes[0][0]))


def _several_units(reshard_after_forward, offload: OffloadPolicy) -> None:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(DIM, DIM), *[_MLP() for _ in range(3)])
    master = copy.deepcopy(model)
    for block in model[1:]:
        fully_shard(block, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    fully_shard(model, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    _train(model, master, f"units, reshard {reshard_after_forward}, {offload}", _rows(4, DIM), 4)


def _root_then_child() -> None:
    torch.manual_seed(42)
    model = nn.Sequential(*[_MLP() for _ in range(3)])
    master = copy.deepcopy(model)
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    x = _rows(8, DIM)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, None, None)
    for run in (lambda m: m(x).sum(), lambda m: m[0](x).sum()):  # the root, then a child
        loss = run(model)
        loss.backward()
        ref_loss = reference.forward_backward(run)
        reference.reduce()
        assert torch.equal(loss.detach(), ref_loss)
        optim.step()
        optim.zero_grad()
        reference.step(set_to_none=True)
    assert_same_shards(model, master, "root, then a child alone", grads=False)
    assert torch.equal(model(x), master(x))


class _CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)

    def forward(self, x):
        return self.outer(self.inner(x) + self.inner(x))


def _unit_called_twice(reshard_after_forward) -> None:
    torch.manual_seed(42)
    model = _CalledTwice()
    master = copy.deepcopy(model)
    fully_shard(model.inner, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    _train(model, master, f"called twice, reshard {reshard_after_forward}", _rows(32, 4), 4)


class _Tied(nn.Module):
    """An embedding whose weight is also the output head's, around blocks that may be
    checkpointed."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.embed = nn.Embedding(32, DIM)
        self.blocks = nn.ModuleList(_MLP() for _ in range(2))
        self.head = nn.Linear(DIM, 32, bias=False)
        self.head.weight = self.embed.weight
        self.checkpointed = checkpointed

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)
        return self.head(h)


def _tied_parameters(checkpointed: bool) -> None:
    torch.manual_seed(42)
    model = _Tied(checkpointed)
    master = copy.deepcopy(model)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    assert model.head.weight is model.embed.weight
    tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(dist.get_rank()))
    _train(model, master, f"tied embedding, checkpointed {checkpointed}", tokens, 4)


def _accumulation_flags(model: nn.Sequential, mode: str, last: bool, keep_gathered: bool):
    """Which units reduce this micro-batch: none but on the last (``all``), all but the
    root's own parameters (``root_only``), or all but the first two blocks."""
    if mode == "all":
        targets, recurse = [model], True
    elif mode == "root_only":
        targets, recurse = [model], False
    else:
        targets, recurse = list(model[1:3]), True
    for module in targets:
        module.set_requires_gradient_sync(last, recurse=recurse)
        if keep_gathered:
            module.set_reshard_after_backward(last, recurse=recurse)


def _accumulate(reshard_after_forward, mode: str, keep_gathered: bool,
                offload: OffloadPolicy) -> None:
    what = (f"accumulation {mode}, reshard {reshard_after_forward}, kept gathered "
            f"{keep_gathered}, {offload}")
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(DIM, DIM), *[_MLP() for _ in range(3)])
    master = copy.deepcopy(model)
    for block in model[1:]:
        fully_shard(block, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    fully_shard(model, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, None, None)
    # units reducing every micro-batch add up per-micro-batch averages: fp32 rounding
    tolerance = {} if mode == "all" else {"rtol": 1e-5, "atol": 1e-6}
    rows = _rows(6, DIM)
    for step in range(3):
        for micro, x in enumerate(rows.chunk(3)):
            _accumulation_flags(model, mode, micro == 2, keep_gathered)
            loss = model(x).sum()
            loss.backward()
            ref_loss = reference.forward_backward(lambda m: m(x).sum())
            torch.testing.assert_close(loss.detach(), ref_loss,
                                       **tolerance or {"rtol": 0, "atol": 0},
                                       msg=lambda m: f"{what}, step {step}.{micro}: {m}")
        reference.reduce()
        assert_same_shards(model, master, f"{what}, step {step}", **tolerance)
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 1)  # zeroed: accumulate into kept grads
        reference.step(set_to_none=step % 2 == 1)


def _one_f_one_b(gather_up_front: bool, keep_gathered: bool) -> None:
    what = f"1F1B, gathered up front {gather_up_front}, kept gathered {keep_gathered}"
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(DIM, DIM), *[_MLP() for _ in range(3)])
    master = copy.deepcopy(model)
    for block in model[1:]:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, None, None)
    if gather_up_front:  # no memory cost: nothing is resharded after forward anyway
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard(async_op=True)
    for micro, x in enumerate(_rows(6, DIM).chunk(3)):
        last = micro == 2
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        if keep_gathered:
            model.set_reshard_after_backward(last)
        loss = model(x).sum()
        loss.backward()
        assert torch.equal(loss.detach(), reference.forward_backward(lambda m: m(x).sum())), \
            f"{what}: micro-batch {micro}"
    reference.reduce()
    assert_same_shards(model, master, what)
    optim.step()
    reference.step(set_to_none=True)
    assert_same_shards(model, master, f"{what}, after the step", grads=False)


def _basics() -> None:
    _roots_without_parameters_or_inputs()
    _to_float64_after_sharding()
    for shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        _one_unit(shapes, largest_dim=False)
    _one_unit([(32, 16), (16, 8)], largest_dim=True)
    for reshard in (True, False, 2):
        _several_units(reshard, OffloadPolicy())
        _unit_called_twice(reshard)
    _several_units(True, CPUOffloadPolicy(pin_memory=False))
    _root_then_child()
    for checkpointed in (False, True):
        _tied_parameters(checkpointed)


@pytest.mark.slow
def test_training_matches_a_single_process_copy_as_in_torchs_fsdp2():
    run_distributed(_basics, 2)


def _accumulation_cases() -> None:
    for reshard in (True, False, 2):
        for mode in ("all", "root_only", "some_mlps"):
            # as torch's test: units kept gathered across backward only when they are
            # kept after forward too, and never for some blocks alone
            for keep_gathered in ((False, True) if reshard is False and mode != "some_mlps"
                                  else (False,)):
                _accumulate(reshard, mode, keep_gathered, OffloadPolicy())
    for mode in ("all", "root_only", "some_mlps"):
        _accumulate(True, mode, False, CPUOffloadPolicy(pin_memory=False))
    for gather_up_front in (False, True):
        for keep_gathered in (False, True):
            _one_f_one_b(gather_up_front, keep_gathered)


@pytest.mark.slow
def test_gradient_accumulation_matches_a_single_process_copy_as_in_torchs_fsdp2():
    run_distributed(_accumulation_cases, 2)
