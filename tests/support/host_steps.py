"""When each unit's forward starts against when its host-thread step ends (OverlappedStep):
the evidence that a unit's gather waits for its own unit's step and for no other."""

import contextlib
import time

import torch
import torch.distributed as dist

import fullshard.overlapped_step as overlapped_step
from fullshard.gpt import lm_loss
from fullshard.testing.models import token_batch


def forward_against_slow_last_step(model, stepper, step_function: str, vocab_size: int,
                                   seq_len: int) -> tuple[bool, list[str]]:
    """Train a step, then slow the host step of the last block (``step_function`` of
    overlapped_step.py, whose fifth argument names the unit) by a second and run the next
    forward and backward. Whether the first block's forward started before that step
    ended and the last block's only after it, and the units stepped meanwhile."""
    events = []
    real = getattr(overlapped_step, step_function)
    last = f"layers.{len(model.layers) - 1}"

    def slow_last(*args):
        if args[4].endswith(last):
            time.sleep(1.0)
        real(*args)
        events.append(("stepped", args[4], time.monotonic()))

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(
            lambda *_a, i=i: events.append(("forward", f"layers.{i}", time.monotonic())))
    x, y = token_batch(dist.get_rank(), 4, vocab_size, seq_len)
    lm_loss(model(x), y).backward()
    setattr(overlapped_step, step_function, slow_last)
    try:
        stepper.step()
        events.clear()
        lm_loss(model(x), y).backward()
        stepper.step()
        stepper.wait()
    finally:
        setattr(overlapped_step, step_function, real)

    def first(kind, suffix):
        return next(t for k, name, t in events if k == kind and name.endswith(suffix))
    last_step = first("stepped", last)
    return (first("forward", "layers.0") < last_step <= first("forward", last),
            sorted({name for kind, name, _t in events if kind == "stepped"}))


@contextlib.contextmanager
def host_steps_slowed(step_function: str, seconds: float, on: bool = True):
    """Within the block, ``step_function`` of overlapped_step.py (each unit's host-thread
    step) sleeps ``seconds`` first: whatever reads the step's results too early reads
    them before it ends. ``on=False``: unchanged."""
    real = getattr(overlapped_step, step_function)

    def slow(*args):
        time.sleep(seconds)
        real(*args)

    setattr(overlapped_step, step_function, slow if on else real)
    try:
        yield
    finally:
        setattr(overlapped_step, step_function, real)


def record_handed_during_backward(stepper, model) -> list[bool]:
    """A list that gets, for each unit ``stepper`` (an OverlappedStep) hands to its host
    thread, whether ``model``'s backward was still running at the time."""
    during = []
    real = stepper._hand_to_host

    def handing(group, *args, **kwargs):
        during.append(model._unit.root.backward.running)
        return real(group, *args, **kwargs)

    stepper._hand_to_host = handing
    return during


def train_and_read(model, opt, stepper, kind: str, vocab_size: int, seq_len: int,
                   steps: int = 4) -> tuple[dict, dict]:
    """Train ``steps`` steps through ``stepper`` (``opt`` itself or an OverlappedStep over
    it), with a scheduler changing the learning rate after each; under ``kind`` "fused" a
    clip coefficient in the step and step 2 skipped by ``found_inf``. The weights and the
    optimizer's states as ``opt.state_dict()`` gives them (which reads states kept on disk)."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    rank = dist.get_rank()
    for step in range(steps):
        x, y = token_batch(10 * step + rank, 6, vocab_size, seq_len)
        lm_loss(model(x), y).backward()
        if kind == "fused":  # the trainer's clip inside the step, and a skip flag
            opt.grad_scale = torch.tensor(1.5 + step)
            opt.found_inf = torch.tensor(float(step == 2))
        stepper.step()
        opt.grad_scale = opt.found_inf = None
        opt.zero_grad(set_to_none=True)
        scheduler.step()
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    states = {(i, name): (v.full_tensor() if hasattr(v, "full_tensor") else v)
              for i, entry in opt.state_dict()["state"].items() for name, v in entry.items()}
    return weights, states


def assert_same_bits(a: tuple[dict, ...], b: tuple[dict, ...]) -> None:
    """Each dict of ``a`` holds the same keys as its peer in ``b``, and equal values."""
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            vx, vy = torch.as_tensor(x[key]), torch.as_tensor(y[key])
            assert torch.equal(vx, vy), (key, (vx - vy).abs().max())
