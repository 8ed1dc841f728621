"""When each unit's forward starts against when its host-thread step ends (OverlappedStep):
the evidence that a unit's gather waits for its own unit's step and for no other."""

import contextlib
import time

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
