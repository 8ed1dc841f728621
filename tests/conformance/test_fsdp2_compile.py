"""``torch.compile`` on sharded models, as torch's FSDP2 tests check it
(test_fully_shard_compile.py and test_fully_shard_training_compile.py, what applies on
CPU), in our own words. Each compiled run trains beside an eager run of the same sharded
model from the same weights, and the losses match:

- a model of units with ``reshard_after_forward=2`` wrapped in ``torch.compile``
  (inductor: torch's training_compile test);
- ``module.compile()`` after ``fully_shard`` (fullshard's hooks run eagerly between
  graphs; torch's test toggles dynamo's ``skip_fsdp_hooks``, which torch 2.13 and 2.15
  no longer have);
- the function running forward and backward compiled (``aot_eager``) over a model whose
  units run several times per forward (each block twice in a row, then every block
  twice more), one eager warm-up step first as torch's test has;
- compiled autograd (the backward traced too) is refused at the first backward, one
  line naming the root (docs/errors.md E332): its traced backward never delivered the
  reduced gradients, so the weights silently stayed as they were. torch's FSDP2 on CPU
  without its traceable-FSDP settings trains wrongly there too (its losses leave the
  eager ones after one compiled step); not run with torch swapped in.

Not here (docs/conformance.md): torch's checks of its own graph ops (``fsdp.copy_``,
``resize_storage_bytes_``, the all-gather reordering passes) read torch's traced FSDP2,
which fullshard does not have; its tests on Triton need a GPU.

Compiling is slow: the file is marked extended (``make test-extended``), one launch of
two ranks.
"""

from __future__ import annotations

import contextlib
import copy
import shutil

import pytest
import torch
import torch.nn as nn

from support.catalogue import matches_documented
from support.steps_beside import rank_rows
from fullshard import fully_shard
from fullshard.testing import run_distributed

DIM = 16


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Reused(nn.Module):
    """Blocks run several times per forward: each twice in a row, then all of them twice."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_MLP() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(block(x))
        for _ in range(2):
            for block in self.blocks:
                x = block(x)
        return x


def _losses(model: nn.Module, step_fn, x: torch.Tensor, steps: int = 4,
            eager_first: bool = False) -> list[float]:
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        stance = (torch.compiler.set_stance("force_eager") if eager_first and step == 0
                  else contextlib.nullcontext())
        with stance:
            losses.append(step_fn(x).item())
        optim.step()
        optim.zero_grad(set_to_none=True)
    return losses


def _forward_backward(model: nn.Module):
    def run(x):
        loss = model(x).sum()
        loss.backward()
        return loss
    return run


def _twins(build, shard) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = build()
    compiled = copy.deepcopy(eager)
    return shard(eager), shard(compiled)


def _shard_mlp_reshard_2(model: _MLP) -> _MLP:
    fully_shard(model.up, reshard_after_forward=2)
    return fully_shard(model, reshard_after_forward=2)


def _shard_blocks(model: _Reused) -> _Reused:
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    return fully_shard(model, reshard_after_forward=True)


def _compiled_model_reshard_2() -> None:
    eager, compiled = _twins(_MLP, _shard_mlp_reshard_2)
    x = rank_rows(8, DIM)
    expected = _losses(eager, _forward_backward(eager), x)
    run = torch.compile(compiled, backend="inductor")
    assert _losses(compiled, _forward_backward(run), x) == pytest.approx(expected, rel=1e-5)


def _module_compile() -> None:
    eager, compiled = _twins(_MLP, fully_shard)
    x = rank_rows(4, DIM)
    expected = _losses(eager, _forward_backward(eager), x)
    torch._dynamo.reset()
    compiled.compile(backend="aot_eager")
    got = _losses(compiled, _forward_backward(compiled), x)
    assert got == pytest.approx(expected, rel=1e-6)


def _compiled_step() -> None:
    eager, compiled = _twins(_Reused, _shard_blocks)
    x = rank_rows(2, DIM)
    expected = _losses(eager, _forward_backward(eager), x, eager_first=True)
    torch._dynamo.reset()
    run = torch.compile(_forward_backward(compiled), backend="aot_eager")
    assert _losses(compiled, run, x, eager_first=True) == pytest.approx(expected, rel=1e-6)


def _compiled_autograd_refused() -> None:
    _, model = _twins(_Reused, _shard_blocks)
    x = rank_rows(2, DIM)
    _losses(model, _forward_backward(model), x, steps=1)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True):
        run = torch.compile(_forward_backward(model), backend="aot_eager")
        with pytest.raises(NotImplementedError) as info:
            run(x)
    assert matches_documented("E332", f"NotImplementedError: {info.value}"), info.value


def _all_cases() -> None:
    _compiled_model_reshard_2()
    _module_compile()
    _compiled_step()
    _compiled_autograd_refused()


@pytest.mark.extended
@pytest.mark.skipif(shutil.which("cc") is None, reason="inductor on CPU needs a C compiler")
def test_compiled_sharded_models_train_as_eager_ones():
    run_distributed(_all_cases, 2, timeout=600)
