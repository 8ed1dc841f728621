"""capture_step: a fullshard training step captured once as a CUDA graph and replayed.

Note [capturing the steady step]
A step of many small units is bound by launches and host time on a GPU: per unit a
gather, a reduce-scatter and the hooks' Python. A CUDA graph replays the whole step's
kernels (forward, backward, the collectives, the optimizer) from one launch, with no
Python at all, which is only right if every replay would have made the host decisions
the capture made. What that takes of fullshard:

* The host decides the same every step: same units, same collectives in the same order,
  same buffer sizes. Eager warm-up steps settle the lazy parts (the root, the prefetch
  order learnt from the first forward, NCCL's communicators, the optimizer's states, the
  pooled buffers) and the last two are compared (steady.py); anything that differs
  between them is refused, since a replay would run the captured step's.
* No host work that a replay would skip is needed for correctness: CPU or disk offload
  (host copies, host optimizer step, threads) and the guard's debug mode (a host
  exchange before every collective) are refused (checks.py). The guard's ordinary
  comparison is kept quiet during capture (``Guard.quiet``: it records, exchanges
  nothing) and run once after it, before the first replay: ranks that captured
  different steps are named there. Replays record nothing; the collectives they issue
  are the captured ones, the same on every rank.
* No host sync inside the step: the last warm-up step runs under
  ``torch.cuda.set_sync_debug_mode("error")`` (an ``.item()``, a host read of gradient
  presence flags of a parameter some rank never used, ``error_if_nonfinite``), so it is
  raised there, eagerly, rather than as a capture error.
* No event from before the capture is waited inside it: the device is synchronized and
  the copy streams forget their read events (``HostCopies.forget_reads``); a
  ``set_post_optim_event`` event is dropped. fullshard's copy stream waits on the
  capture stream and the capture stream on it (Note [streams and events]), which is
  how side streams join a capture.
* Memory the graph uses stays the graph's: buffers allocated or resized inside the
  capture come from the graph's private pool (``pool``) and the pooled buffers kept
  between steps (Note [which buffers are pooled]) hold their addresses; tensors made
  before capture and kept (the flat shards, persistent sharded gradients, optimizer
  states, static inputs) are read and written in place by every replay.
* The optimizer's numbers are baked in: a step counter must be on the device
  (``capturable=True``) and a Python learning rate cannot change after capture
  (numbers.py refuses a replay after it did; a tensor ``lr`` is read by the graph).

None of this has run on a GPU: the refusals, the warm-up comparison, the copy into the
static inputs and the quiet guard are tested on CPU; the capture and replay are not.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import nn

from ..core.guard.divergence import BACKWARD, Guard
from ..core.state import units_in
from .checks import refuse_device, refuse_uncapturable
from .errors import CaptureError
from .inputs import StaticInputs
from .numbers import GroupNumbers
from .steady import check_steady, record_steps

__all__ = ["capture_step", "CapturedStep", "CaptureError", "quiet_guards"]


class CapturedStep:
    """A captured step: ``step(*fresh_inputs)`` copies the inputs into the static ones,
    replays the graph and returns ``outputs`` (what ``step_fn`` returned at capture,
    rewritten in place by every replay)."""

    def __init__(self, graph, inputs: StaticInputs, outputs, numbers: GroupNumbers):
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.numbers = numbers

    def __call__(self, *fresh):
        self.numbers.check_unchanged()
        self.inputs.copy_in(fresh)
        self.graph.replay()
        return self.outputs


def capture_step(step_fn: Callable, *static_inputs: torch.Tensor, model: nn.Module,
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                 warmup: int = 3, pool=None,
                 capture_error_mode: str = "thread_local") -> CapturedStep:
    """Run ``step_fn(*static_inputs)`` ``warmup`` times eagerly, then capture one more
    call in a CUDA graph (Note [capturing the steady step]). ``step_fn`` does a whole
    training step of ``model`` (forward, backward, ``optimizer.step()``, zero_grad) and
    returns what the caller reads after each replay (the loss). ``pool`` is a
    ``torch.cuda.graph_pool_handle()`` to share with other graphs; ``capture_error_mode``
    is ``torch.cuda.graph``'s (thread_local: the gloo and NCCL threads are not the
    capturing one). Refuses what a graph cannot hold with a CaptureError."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    device = refuse_uncapturable(model, optimizers, warmup)
    inputs = StaticInputs(static_inputs, device)
    refuse_device(model, device)
    check_steady(_warm_up(step_fn, inputs.tensors, warmup, device))
    guards = _ready_for_capture(model, device)
    graph = torch.cuda.CUDAGraph()
    with quiet_guards(guards):
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
            outputs = step_fn(*inputs.tensors)
    for guard in guards:
        guard.check(BACKWARD)  # what every rank captured, compared once
    return CapturedStep(graph, inputs, outputs, GroupNumbers(optimizers))


def _warm_up(step_fn: Callable, inputs: tuple, steps: int, device: torch.device):
    """The eager steps, on a side stream as torch's capture examples run them (so that
    the caching allocator's and NCCL's lazy work is not on the stream captured next)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        records = record_steps(step_fn, inputs, steps, last_step=_no_host_sync)
    torch.cuda.current_stream(device).wait_stream(side)
    return records


@contextlib.contextmanager
def _no_host_sync():
    """A host sync in the step raises here, eagerly, with torch's message."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _ready_for_capture(model: nn.Module, device: torch.device) -> list[Guard]:
    """Nothing recorded before the capture is waited inside it; the guards have
    compared everything the warm-up did. The guards of the model's roots."""
    torch.cuda.synchronize(device)
    roots = list(dict.fromkeys(u.root for u in units_in(model) if u.root is not None))
    guards = []
    for root in roots:
        root.copies.forget_reads()
        root.unit.post_optim_event = None
        if root.guard is not None:
            root.guard.channel.drain()  # a comparison one step behind, finished
            root.guard.ensure_agreed(BACKWARD)
            guards.append(root.guard)
    return guards


@contextlib.contextmanager
def quiet_guards(guards: Sequence[Guard]):
    """Inside the block (a capture) the guards record what runs and exchange nothing;
    the caller compares after it."""
    for guard in guards:
        guard.quiet = True
    try:
        yield
    finally:
        for guard in guards:
            guard.quiet = False
