"""``--parallel.step_in_backward``: the offloaded blocks stepped during backward.

Note [the trainer's step in backward]
The trainer wraps the backward of each step's last micro-batch, the one that reduces
(the earlier ones, under ``set_requires_gradient_sync(False)``, reduce nothing and so
step nothing), in each ``OverlappedStep``'s ``stepping_in_backward()``: every
offloaded block (CPU or disk) goes to the host thread as soon as its gradients are handed out
(Note [the host step overlapped with backward]), and the step after backward steps the
rest. The configuration refuses what that cannot serve (train/config/schema.py): a clip
and fp16's loss scale, whose coefficients exist only after the whole backward, the
delayed update, and runs with no block on the host thread. The gradient norm the trainer
reports is over every gradient, those handed to the host thread included
(``OverlappedStep.gradients_of``), in the order of the model's parameters, so it is the
default trainer's to the bit, as are the losses and weights.

One difference: the default trainer skips a step whose gradient norm is not finite (on
the device, through the fused step's ``found_inf``), then ends the run without saving
(``Diverged``). Here the blocks stepped during backward have taken that step before the
norm exists; the run still ends at that step without saving, so no checkpoint holds it.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from ..grad_norm import norm_of_grads
from ..overlapped_step import OverlappedStep


class BackwardSteps:
    """The trainer's OverlappedSteps stepping the offloaded blocks during the backward of
    each step's last micro-batch (Note [the trainer's step in backward])."""

    def __init__(self, overlapped: list[OverlappedStep | None]):
        self.overlapped = [o for o in overlapped if o is not None]

    @contextlib.contextmanager
    def during(self, reduces: bool):
        """Around one micro-batch's backward: ``reduces``, the last one's, steps."""
        with contextlib.ExitStack() as stack:
            if reduces:
                for overlapped in self.overlapped:
                    stack.enter_context(overlapped.stepping_in_backward())
            yield

    def grad_norm(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """The global norm of every gradient of ``params``, handed out ones included."""
        params = list(params)
        grads = [p.grad for p in params]
        for overlapped in self.overlapped:
            handed = overlapped.gradients_of(params)
            grads = [g if g is not None else h for g, h in zip(grads, handed)]
        return norm_of_grads(grads)
