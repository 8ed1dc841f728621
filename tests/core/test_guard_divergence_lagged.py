"""The guard one step behind (core/guard/divergence.py, Note [a comparison one step behind]),
as it runs where the host is ahead of the device: made to run so on CPU ranks here (the
gloo reductions then carry no digests either, as on NCCL). Each backward's comparison is
left in flight on the control channel and finished at the next settle or check-in: the
same losses as comparing at once, and a divergence still named on every rank, one step
late, and before any checkpoint is written."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import fully_shard
from fullshard.core.state import unit_of
from fullshard.testing import run_distributed


class _Parallel(nn.Module):
    """Three same-shaped units on one input, run in the order given."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(48, 16)
        self.branches = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, idx, order=(0, 1, 2)):
        x = self.emb(idx)
        return sum(self.branches[i](x) for i in order)


def _model(lagged: bool):
    os.environ["FULLSHARD_ARRIVAL_TIMEOUT"] = "30"
    torch.manual_seed(0)
    model = _Parallel()
    for branch in model.branches:
        fully_shard(branch)
    fully_shard(model)
    model.set_bucket_numel(0)
    for unit in [model, *model.branches]:  # each unit gathers its own, in its forward
        unit.set_modules_to_forward_prefetch([])

    def behind(module, _args):  # after fullshard's own pre-forward: the guard exists
        unit_of(module).root.guard.lagged = lagged

    model.register_forward_pre_hook(behind)
    return model


def _train(lagged: bool, reordered_on_rank1_at: int = -1, save_to: str = ""):
    """Train and evaluate each step; at step ``reordered_on_rank1_at`` rank 1 evaluates
    the branches in another order: same-sized gathers paired with the wrong units, which
    no wait notices (as on NCCL, where waits do not block the host)."""
    model = _model(lagged)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 48, (2, 3), generator=torch.Generator().manual_seed(1))
    losses, in_flight = [], []
    for step in range(4):
        loss = model(idx).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        guard = unit_of(model).root.guard
        in_flight.append(guard.channel._in_flight is not None)
        reordered = dist.get_rank() == 1 and step == reordered_on_rank1_at
        with torch.no_grad():
            evaluated = model(idx, (0, 2, 1) if reordered else (0, 1, 2)).square().mean()
        losses.append((round(loss.item(), 6), round(evaluated.item(), 6)))
        if save_to:
            from fullshard import checkpoint
            checkpoint.save(save_to, model, opt)
    return losses, in_flight


@pytest.mark.slow
def test_a_comparison_left_in_flight_trains_as_one_compared_at_once():
    at_once = run_distributed(_train, 2, False, timeout=120)
    behind = run_distributed(_train, 2, True, timeout=120)
    assert [losses for losses, _ in behind] == [losses for losses, _ in at_once]
    assert all(flags == [True] * 4 for _, flags in behind), behind  # never waited at once
    assert all(not any(flags) for _, flags in at_once), at_once


def _raised_at(text: str) -> int:
    return text.count("DivergenceError: fullshard: ranks diverged at step 3 (forward "
                      "without grad")


@pytest.mark.slow
def test_gathers_in_different_orders_are_named_at_the_next_comparison():
    """Named at step 2's settle (the evaluation is the root's 4th forward: step 3), on
    both ranks, with what each ran."""
    with pytest.raises(AssertionError) as failure:
        run_distributed(_train, 2, True, 1, timeout=120)
    text = str(failure.value)
    assert _raised_at(text) == 2, text[-3000:]
    assert "rank 0 ran the forward of 'branches.1' (forward without grad of step 3); rank 1 " \
        "ran the forward of 'branches.2'" in text, text[-3000:]
    assert "in settle_gradients" in text  # raised as the next backward settles


@pytest.mark.slow
def test_no_checkpoint_is_written_after_an_unnamed_divergence(tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_distributed(_train, 2, True, 1, str(tmp_path / "ckpt"), timeout=120)
    text = str(failure.value)
    assert _raised_at(text) == 2, text[-3000:]
    assert "checkpoint.save" in text  # named at the save's check-in, before writing
    assert not (tmp_path / "ckpt" / "step_000001").exists()


_LAST_STEP_SCRIPT = """
import sys, torch, torch.distributed as dist, torch.nn as nn
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
from fullshard import fully_shard
from fullshard.core.state import unit_of
class Ordered(nn.Sequential):
    order = (0, 1, 2)
    def forward(self, x):
        for i in self.order:
            x = self[i](x)
        return x
torch.manual_seed(0)
model = Ordered(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
for layer in model:
    fully_shard(layer)
fully_shard(model)
model.set_bucket_numel(0)
for unit in [model, *model]:
    unit.set_modules_to_forward_prefetch([])
x = torch.ones(2, 8)
model(x).sum().backward()
unit_of(model).root.guard.lagged = True
if rank == 1:
    model.order = (0, 2, 1)  # the last forward: same sizes, another order
with torch.no_grad():
    model(x)
print("end of the program", flush=True)
"""


@pytest.mark.slow
def test_a_divergence_in_the_last_step_is_named_at_exit(tmp_path):
    """Its comparison is still in flight when the program ends: finished at exit, the
    divergence is said on every rank rather than never."""
    import subprocess
    import sys

    script = tmp_path / "last_step.py"
    script.write_text(_LAST_STEP_SCRIPT)
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in ranks]
    for out, err in outs:
        assert "end of the program" in out, err[-2000:]
        assert "DivergenceError: fullshard: ranks diverged" in err, err[-2000:]
