"""The optimizer's local-shard step (Note [optimizer steps on local shards])."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fullshard import fully_shard, optim as fs_optim
from fullshard.testing import run_distributed
from fullshard.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=2, n_heads=2)


class SubclassedAdamW(torch.optim.AdamW):
    """Not on the elementwise list (a subclass may reduce over whole parameters)."""


def _train(model, opt, steps=4):
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
        loss = lm_loss(model(x), torch.roll(x, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded(base):
    model = copy.deepcopy(base)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _local_vs_dtensor_worker(opt_name):
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
            "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
            "subclass": lambda ps: SubclassedAdamW(ps, lr=1e-2)}[opt_name]
    torch.manual_seed(0)
    base = GPT(CFG)
    fast, slow = _sharded(base), _sharded(base)
    fast_opt, slow_opt = make(fast.parameters()), make(slow.parameters())
    fs_optim.set_local_step(True)
    fast_losses = _train(fast, fast_opt)
    fs_optim.set_local_step(False)
    try:
        slow_losses = _train(slow, slow_opt)
    finally:
        fs_optim.set_local_step(True)
    assert fast_losses == slow_losses
    for p, q in zip(fast.parameters(), slow.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
    # outside step() the optimizer holds DTensor params and DTensor states
    for group in fast_opt.param_groups:
        assert all(isinstance(p, DTensor) for p in group["params"])
    for p, state in fast_opt.state.items():
        assert isinstance(p, DTensor)
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert isinstance(v, DTensor) and v.placements == (Shard(0),), k
    sd = fast_opt.state_dict()
    assert len(sd["state"]) == len(list(fast.parameters()))
    return fast_losses


@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "rmsprop", "subclass"])
@pytest.mark.slow
def test_local_step_matches_dtensor_step_bitwise(opt_name):
    run_distributed(_local_vs_dtensor_worker, 2, opt_name)


def _raising_step_worker():
    torch.manual_seed(0)
    model = _sharded(GPT(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    boom = opt.register_step_post_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    lm_loss(model(x), x).backward()
    # torch runs per-optimizer post hooks before global ones: the swap is still in
    # place when the step raises, and the next step must put it right first
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    boom.remove()
    opt.step()
    assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    assert all(isinstance(p, DTensor) for p in opt.state)
    return True


def test_step_that_raises_leaves_optimizer_usable():
    assert all(run_distributed(_raising_step_worker, 2))


def _hooks_per_step(directory):
    from fullshard import DiskOffloadPolicy
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    for layer in model:  # states on disk: stepped a chunk at a time
        fully_shard(layer, offload_policy=DiskOffloadPolicy(path=directory))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls = {"pre": 0, "post": 0}
    opt.register_step_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1))
    opt.register_step_post_hook(lambda *a: calls.__setitem__("post", calls["post"] + 1))
    for _ in range(2):
        model(torch.randn(3, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    return calls


def test_step_hooks_run_once_per_step_when_states_step_in_chunks(tmp_path):
    # each chunk of a disk step once ran the optimizer's hooked step: a user's hooks
    # (an EMA update, a step counter) ran once per chunk as well
    for calls in run_distributed(_hooks_per_step, 2, str(tmp_path)):
        assert calls == {"pre": 2, "post": 2}, calls


def _closure_worker(pass_as):
    torch.manual_seed(0)
    base = GPT(CFG)
    plain, closed = _sharded(base), _sharded(base)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    closed_opt = torch.optim.AdamW(closed.parameters(), lr=1e-2)
    expected = _train(plain, plain_opt)
    got = []
    for step in range(len(expected)):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)

        def closure():  # forward and backward inside step(), as Lightning does
            loss = lm_loss(closed(x), torch.roll(x, -1, 1))
            loss.backward()
            return loss
        loss = closed_opt.step(closure) if pass_as == "arg" else closed_opt.step(closure=closure)
        closed_opt.zero_grad()
        got.append(loss.item())
    assert got == expected
    for p, q in zip(plain.parameters(), closed.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
    return True


@pytest.mark.parametrize("pass_as", ["arg", "keyword"])
def test_step_with_a_closure_trains_as_without(pass_as):
    # the local step once swapped in local tensors before the closure's backward ran,
    # so the step updated with no gradients (found by Lightning's automatic optimization)
    assert all(run_distributed(_closure_worker, 2, pass_as))


def test_optimizers_without_fullshard_parameters_are_left_alone():
    """The step hooks are process-wide (optim.py): an optimizer holding no fullshard
    parameter must see exactly what it would without fullshard, closure included."""
    from fullshard.optim import _pre_step

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    params = opt.param_groups[0]["params"]
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = model(torch.ones(3, 4)).sum()
        loss.backward()
        return loss

    assert _pre_step(opt, (opt, closure), {}) is None  # nothing replaced
    loss = opt.step(closure)
    assert calls == [1] and loss is not None
    assert opt.param_groups[0]["params"] is params and all(p is q for p, q in
                                                           zip(params, model.parameters()))
    assert all(type(v) is torch.Tensor for s in opt.state.values() for v in s.values())


@pytest.mark.slow
def test_importing_fullshard_installs_no_optimizer_hook_the_first_fully_shard_does():
    import subprocess
    import sys
    code = (
        "import torch\n"
        "from torch.optim import optimizer as o\n"
        "before = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))\n"
        "import fullshard\n"
        "after_import = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))\n"
        "import torch.distributed as dist, tempfile, os\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0,"
        " world_size=1)\n"
        "fullshard.fully_shard(torch.nn.Linear(4, 4))\n"
        "after_shard = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))\n"
        "fullshard.fully_shard(torch.nn.Linear(4, 4))\n"
        "again = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))\n"
        "print((before, after_import, after_shard, again))\n"
        "dist.destroy_process_group()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    import ast
    before, after_import, after_shard, again = ast.literal_eval(out.stdout.splitlines()[-1])
    assert after_import == before
    assert after_shard == (before[0] + 1, before[1] + 1) == again


def _rprop_and_asgd_like_one_process():
    from fullshard.testing import models as m
    from fullshard.testing.parity import check_parity

    def shard(model):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    for name, lr in (("Rprop", 1e-2), ("ASGD", 0.05)):
        check_parity(m.OddMLP, shard, lambda s: m.float_batch(s, 8, 7, 3), m.mse_loss,
                     steps=5, optimizer=name, lr=lr)
    return True


@pytest.mark.slow
def test_rprop_and_asgd_step_on_shards_like_one_process():
    """Both are elementwise: stepped on each rank's shard (Rprop fails on DTensors)."""
    assert all(run_distributed(_rprop_and_asgd_like_one_process, 2))


def _optimizers_that_cannot_step_shards():
    def first_step(make, shape=(3, 6)):
        model = nn.Sequential(nn.Linear(8, 6), nn.Linear(shape[1], shape[0]))
        fully_shard(model)
        opt = make(model.parameters())

        def closure():
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).sum()
            loss.backward()
            return loss
        opt.step(closure)
    refused = {}
    for name, make in (("SparseAdam", torch.optim.SparseAdam),
                       ("LBFGS", torch.optim.LBFGS)):
        with pytest.raises(RuntimeError) as err:
            first_step(make)
        refused[name] = str(err.value)
    first_step(torch.optim.LBFGS, shape=(4, 6))  # evenly sharded: DTensor's path takes it
    return refused


@pytest.mark.slow
def test_optimizers_that_cannot_step_shards_are_refused_at_the_first_step():
    for refused in run_distributed(_optimizers_that_cannot_step_shards, 2):
        for name, message in refused.items():
            assert message.startswith(f"fullshard: {name} cannot step sharded parameters: "), message
            assert "Rprop, ASGD on each rank's shard" in message, message
        assert "'1.weight' (3, 6) splits unevenly over 2 ranks" in refused["LBFGS"]


def _whole_matrix_questions() -> list[str]:
    import fullshard.whole_matrix as whole_matrix

    asked = []
    real = whole_matrix.needs_whole_matrices
    whole_matrix.needs_whole_matrices = lambda opt: asked.append(type(opt).__name__) or real(opt)
    try:
        torch.manual_seed(0)
        model = _sharded(GPT(CFG))
        _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), steps=3)
    finally:
        whole_matrix.needs_whole_matrices = real
    return asked


def test_whether_an_optimizer_needs_whole_matrices_is_decided_at_its_first_step():
    """Asked once per optimizer, not at every step (a steady step stays out of
    whole_matrix/: docs/architecture.md)."""
    assert run_distributed(_whole_matrix_questions, 2) == [["AdamW"], ["AdamW"]]
