"""A program that catches DivergenceError ends (Note [groups left with a collective that
cannot finish] in core/comm.py).

Rank 0 runs one forward more than rank 1: each is left with a collective the other never
matches. Both catch the error the guard raises and end. Without the groups kept past exit,
gloo's process group, destroyed at the interpreter's end, waits for that collective until
its timeout (60 s here, 30 minutes by default) before the process can go."""

import subprocess
import sys
import time

import pytest

_SCRIPT = """
import datetime, sys, torch, torch.distributed as dist, torch.nn as nn
rank, store, destroy = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
from fullshard import fully_shard
from fullshard.core.guard.divergence import DivergenceError
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step():
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
try:
    step()
    if rank == 0:
        model(torch.ones(2, 8))  # a forward the other rank does not run
    step()
except DivergenceError as err:
    print("caught:", str(err).splitlines()[0][:80], flush=True)
if destroy:
    dist.destroy_process_group()
print("end of the program", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("destroy", [False, pytest.param(True, marks=pytest.mark.extended)],
                         ids=["exit", "destroy_then_exit"])
def test_a_program_that_catches_a_divergence_ends(tmp_path, destroy):
    script = tmp_path / "diverge.py"
    script.write_text(_SCRIPT)
    start = time.monotonic()
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"),
                               str(int(destroy))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=50) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for p, (out, err) in zip(ranks, outs):
        assert "caught: fullshard: ranks diverged" in out, (out, err[-2000:])
        assert "end of the program" in out, err[-2000:]
        assert p.returncode == 0, err[-2000:]
    # the error comes after one stall slice (6 s at a 60 s timeout); the exit at once
    assert time.monotonic() - start < 50
