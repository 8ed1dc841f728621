"""reshard_after_forward=N (hpZ, core/features/post_forward.py): after forward a unit keeps its
parameters gathered within groups of N ranks, and backward re-gathers from those; the
training equals one process's."""

import pytest
import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import models as m
from fullshard.testing import run_distributed
from fullshard.testing.parity import check_parity

CFG = GPTConfig(vocab_size=48, seq_len=12, d_model=24, n_layers=3, n_heads=4)


def _gpt_batch(step, n):
    return m.token_batch(step, n, CFG.vocab_size, CFG.seq_len)


def _hpz_parity(case):
    if case == "gpt":
        build, opt = (lambda: GPT(CFG)), "sgd"
        batch = _gpt_batch
        loss = lambda model, b: lm_loss(model(b[0]), b[1])  # noqa: E731
    else:
        build, opt, loss = m.OddMLP, "adamw", m.mse_loss
        batch = lambda s, n: m.float_batch(s, n, 7, 3)  # noqa: E731

    def shard(model):
        for path in ("layers.0", "layers.1", "layers.2") if case == "gpt" else ("blocks.0",):
            fully_shard(model.get_submodule(path), reshard_after_forward=2)
        fully_shard(model, reshard_after_forward=2)
        model.set_bucket_numel(0)
    return check_parity(build, shard, lambda s: batch(s, 8), loss, optimizer=opt,
                        steps=5).losses


@pytest.mark.parametrize("case", ["gpt", "mlp"])
@pytest.mark.slow
def test_reshard_after_forward_int_parity(case):
    run_distributed(_hpz_parity, 4, case)


def _hpz_collective_sizes():
    from fullshard.core import group as group_module
    from fullshard.core.features import post_forward as post_forward_module

    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=2)
    fully_shard(model)
    model.set_bucket_numel(0)
    seen = []
    real = group_module.all_gather

    def recording(out, shard, pg, async_op=False, **kwargs):
        seen.append((phase[0], pg.size(), out.numel()))
        return real(out, shard, pg, async_op=async_op, **kwargs)
    phase = ["forward"]
    group_module.all_gather = post_forward_module.all_gather = recording
    try:
        x, y = _gpt_batch(dist.get_rank(), 2)
        loss = lm_loss(model(x), y)
        phase[0] = "backward"
        loss.backward()
    finally:
        group_module.all_gather = post_forward_module.all_gather = real
    return seen


@pytest.mark.slow
def test_reshard_after_forward_int_gathers_within_the_smaller_group():
    """Forward gathers over all 4 ranks; backward re-gathers each layer from 2 ranks."""
    seen = run_distributed(_hpz_collective_sizes, 4)[0]
    forward = [s for s in seen if s[0] == "forward"]
    backward = [s for s in seen if s[0] == "backward"]
    assert forward and all(size == 4 for _, size, _ in forward)
    assert len(backward) == CFG.n_layers and all(size == 2 for _, size, _ in backward)


_SUBGROUP_SCRIPT = """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from fullshard.core.features import post_forward

dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
made = []
real = dist.new_group
dist.new_group = lambda *a, **k: made.append((k.get("ranks"), k.get("use_local_synchronization"))) or real(*a, **k)
group = post_forward.subgroup_of(mesh.get_group("shard"), 2)
assert post_forward.subgroup_of(mesh.get_group("shard"), 2) is group
print(made)
"""


@pytest.mark.slow
def test_hybrid_shard_groups_make_only_their_own_subgroups():
    """Rank 5 of a 2 x 4 hybrid mesh (shard group 4-7) with reshard_after_forward=2 makes
    one subgroup, {4, 5}, among its members only: every replica making its own subgroups
    the ordinary way gave disjoint groups the same name (and store keys)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SUBGROUP_SCRIPT], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[([4, 5], True)]", out.stdout
