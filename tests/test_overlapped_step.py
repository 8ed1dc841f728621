"""OverlappedStep: CPU-offloaded units stepped on a host thread while the next forward runs
(Note [the host step overlapped with the next forward]). The same bits as
``optimizer.step()``, whatever the optimizer's flags; each unit's forward waits for its own
unit's step and no other; state dicts and a resume see the stepped values."""

import contextlib

import pytest
import torch
import torch.distributed as dist

import fullshard.overlapped_step as overlapped_step
from fullshard import CPUOffloadPolicy, OverlappedStep, fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from support.catalogue import matches_documented
from support.host_steps import (assert_same_bits, forward_against_slow_last_step,
                                host_steps_slowed, record_handed_during_backward,
                                train_and_read)

CFG = GPTConfig(vocab_size=40, seq_len=10, d_model=16, n_layers=4, n_heads=2)


def _model(offloaded):
    torch.manual_seed(0)
    model = GPT(CFG)
    policy = CPUOffloadPolicy(pin_memory=False)
    for i, layer in enumerate(model.layers):
        fully_shard(layer, offload_policy=policy if i in offloaded else None)
    fully_shard(model, offload_policy=policy if "root" in offloaded else None)
    model.set_bucket_numel(0)  # a group per block: the order of the units is visible
    return model


def _optimizer(model, kind):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kind == "tensor_lr":  # a scheduler changes a tensor lr in place after each step
        return torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3), fused=True)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1,
                             fused=kind == "fused", foreach=kind == "foreach")


def _train(offloaded, kind, overlapped):
    model = _model(offloaded)
    opt = _optimizer(model, kind)
    stepper = OverlappedStep(opt) if overlapped else opt
    return train_and_read(model, opt, stepper, kind, CFG.vocab_size, CFG.seq_len)


def _same_bits(offloaded, kind):
    assert_same_bits(_train(offloaded, kind, overlapped=False),
                     _train(offloaded, kind, overlapped=True))
    return True


@pytest.mark.parametrize("world,offloaded,kind", [
    (2, {0, 1, 2, 3, "root"}, "fused"),
    (2, {1, 3}, "foreach"),
    (3, {2, 3}, "fused"),
    (2, {0, 3}, "sgd"),
    (2, {0, 1, 2, 3}, "tensor_lr"),
])
def test_the_same_bits_as_the_optimizers_own_step(world, offloaded, kind):
    assert all(run_distributed(_same_bits, world, offloaded, kind))


def _forward_waits_per_unit():
    """The last block's host step is slow: the first block's forward must start before it
    ends, the last block's forward only after."""
    model = _model({0, 1, 2, 3})
    stepper = OverlappedStep(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return forward_against_slow_last_step(model, stepper, "_step_unit", CFG.vocab_size,
                                          CFG.seq_len)


def test_each_forward_waits_for_its_own_units_step_only():
    for waited, names in run_distributed(_forward_waits_per_unit, 2):
        assert waited, names
        assert names == [f"layers.{i}" for i in range(4)], names


def _state_dicts_wait():
    """State dicts taken right after step() (a checkpoint) hold the stepped values, and
    a model resumed from them trains on as the uninterrupted one does."""
    results = []
    for overlapped in (False, True):
        with host_steps_slowed("_step_unit", 0.2, on=overlapped):
            results.append(_state_dicts_once(overlapped))
    (m0, o0, a0), (m1, o1, a1) = results
    return ([k for k in m0 if not torch.equal(m0[k], m1[k])],
            [k for k in o0 if not torch.equal(torch.as_tensor(o0[k]), torch.as_tensor(o1[k]))],
            [k for k in a0 if not torch.equal(a0[k], a1[k])])


def _state_dicts_once(overlapped):
    model = _model({0, 1, 2, 3, "root"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepper = OverlappedStep(opt) if overlapped else opt
    x, y = token_batch(dist.get_rank(), 4, CFG.vocab_size, CFG.seq_len)
    for _ in range(2):
        lm_loss(model(x), y).backward()
        stepper.step()
        opt.zero_grad()
    saved_model = {k: v.full_tensor() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()
    saved_opt = {(i, k): (v.full_tensor() if hasattr(v, "full_tensor") else v)
                 for i, entry in saved_opt["state"].items() for k, v in entry.items()}
    # resume: a new model and optimizer loaded from the states, trained one step more
    resumed = _model({0, 1, 2, 3, "root"})
    resumed.load_state_dict(model.state_dict())
    ropt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    ropt.load_state_dict(opt.state_dict())
    rstepper = OverlappedStep(ropt) if overlapped else ropt
    lm_loss(resumed(x), y).backward()
    rstepper.step()
    rstepper.wait() if overlapped else None
    after = {k: v.full_tensor() for k, v in resumed.state_dict().items()}
    return saved_model, saved_opt, after


@pytest.mark.slow
def test_state_dicts_wait_and_a_resume_trains_on_exactly():
    for differ in run_distributed(_state_dicts_wait, 2):
        assert differ == ([], [], []), differ


def _host_error_raised_at_the_next_forward():
    model = _model({0, 1, 2, 3})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepper = OverlappedStep(opt)

    def broken(_opt):
        raise OSError("no space left on device")

    overlapped_step.step_alone = broken  # what the host thread's step calls
    x, y = token_batch(dist.get_rank(), 4, CFG.vocab_size, CFG.seq_len)
    lm_loss(model(x), y).backward()
    stepper.step()
    try:
        model(x)
    except RuntimeError as error:
        return f"RuntimeError: {error}"
    return "no error"


def test_an_error_on_the_host_thread_is_raised_at_the_next_forward_naming_the_unit():
    for message in run_distributed(_host_error_raised_at_the_next_forward, 2):
        assert matches_documented("E292", message) and "layers.0" in message, message


def test_misuse_is_refused_in_one_line():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(TypeError, match="LBFGS is not one of the elementwise optimizers"):
        OverlappedStep(torch.optim.LBFGS(params))
    with pytest.raises(ValueError, match="closure"):
        OverlappedStep(torch.optim.SGD(params, lr=0.1)).step(lambda: 0.0)


def test_without_offload_it_is_the_optimizers_step():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = OverlappedStep(opt)
    model(torch.ones(1, 3)).sum().backward()
    before = model.weight.detach().clone()
    stepper.step()
    assert torch.equal(model.weight.detach(), before - 0.1 * model.weight.grad)


# -- stepping during backward (Note [the host step overlapped with backward]) ---------------
def _train_in_backward(offloaded, kind, in_backward, steps=4, micro=1):
    model = _model(offloaded)
    opt = _optimizer(model, kind)
    stepper = OverlappedStep(opt)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    rank = dist.get_rank()
    handed_during_backward = record_handed_during_backward(stepper, model)
    for step in range(steps):
        for m in range(micro):
            last = m == micro - 1
            x, y = token_batch(100 * step + 10 * m + rank, 6, CFG.vocab_size, CFG.seq_len)
            model.set_requires_gradient_sync(last)
            loss = lm_loss(model(x), y)
            with stepper.stepping_in_backward() if in_backward and last \
                    else contextlib.nullcontext():
                loss.backward()
        stepper.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
    stepper.wait()
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    states = {(k, name): (v.full_tensor() if hasattr(v, "full_tensor") else v)
              for k, p in model.named_parameters() for name, v in opt.state[p].items()}
    return weights, states, handed_during_backward


def _same_bits_in_backward(offloaded, kind, micro):
    *plain, _ = _train_in_backward(offloaded, kind, in_backward=False, micro=micro)
    *stepped, during = _train_in_backward(offloaded, kind, in_backward=True, micro=micro)
    assert_same_bits(plain, stepped)
    return during


@pytest.mark.parametrize("world,offloaded,kind,micro", [
    (2, {0, 1, 2, 3, "root"}, "foreach", 1),
    pytest.param(3, {1, 2, 3}, "sgd", 1, marks=pytest.mark.slow),
    (2, {0, 1, 2, 3}, "tensor_lr", 2),  # accumulation: only the last backward steps
])
def test_stepping_in_backward_gives_the_same_bits_and_steps_during_backward(
        world, offloaded, kind, micro):
    for during in run_distributed(_same_bits_in_backward, world, offloaded, kind, micro):
        blocks = len([u for u in offloaded if u != "root"])
        # every offloaded block of every step handed over while backward still ran (the
        # root's group is the last reduced: the final callback may hand it out)
        assert sum(during) >= 4 * blocks, during


def _refuses_a_clip_coefficient():
    model = _model({0, 1})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    stepper = OverlappedStep(opt)
    opt.grad_scale = torch.tensor(0.5)
    with pytest.raises(ValueError, match="grad_scale set, a clip or loss-scale coefficient"):
        with stepper.stepping_in_backward():
            pass
    opt.grad_scale = None
    with stepper.stepping_in_backward():
        with pytest.raises(RuntimeError, match="the blocks do not nest"):
            with stepper.stepping_in_backward():
                pass
    return True


def test_stepping_in_backward_refuses_a_clip_and_nesting():
    assert all(run_distributed(_refuses_a_clip_coefficient, 2))


def _norms_with_handed_gradients():
    from fullshard.grad_norm import grad_norm, norm_of_grads
    norms = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = _model({0, 1, 2, 3, "root"})
        stepper = OverlappedStep(torch.optim.AdamW(model.parameters(), lr=1e-3))
        x, y = token_batch(dist.get_rank(), 6, CFG.vocab_size, CFG.seq_len)
        loss = lm_loss(model(x), y)
        with stepper.stepping_in_backward() if in_backward else contextlib.nullcontext():
            loss.backward()
        params = list(model.parameters())
        handed = sum(p.grad is None for p in params)
        norms.append((grad_norm(params), norm_of_grads(stepper.gradients_of(params)), handed))
        stepper.step()
        assert all(g is None for g in stepper.gradients_of(params))  # the step took them
        stepper.wait()
    return norms


def test_gradients_of_finds_the_gradients_handed_out_during_backward():
    """After a backward stepping in backward, the parameters' norm over gradients_of is
    the plain backward's norm to the bit, though most ``.grad`` are gone to the host."""
    for (plain, plain_all, none), (missing, found, handed) in run_distributed(
            _norms_with_handed_gradients, 2):
        assert none == 0 and handed > 0
        assert torch.equal(plain, plain_all) and torch.equal(found, plain)
        assert not torch.equal(missing, plain)  # .grad alone misses the handed ones
