"""BackwardSignals: whether one unit's backward is over, from the module-boundary signals.

The hooks (core/hooks.py) watch each forward call's inputs; this object counts what
those watches report for one unit's group (Note [when a unit's backward is done]):
forward calls whose inputs are watched and whose input gradients are still to come,
those already computed in this backward, and forward calls with grad whose inputs
needed none (never watched). The estimator's trace (memory/activations.py) records the
same three signals with a stand-in of its own.
"""

from __future__ import annotations

from typing import Callable

from .schedule import backward_is_done


class BackwardSignals:
    """One unit's backward signals; ``on_done`` runs after each computed input gradient
    (the hooks check ``done`` there and reduce the unit when it is)."""

    __slots__ = ("live", "fired", "unwatched_calls", "epoch", "on_done")

    def __init__(self) -> None:
        self.live = 0
        self.fired = 0
        self.unwatched_calls = 0
        self.epoch = 0  # bumped when a backward is forgotten: older watches are void
        self.on_done: Callable[[], None] | None = None

    @property
    def done(self) -> bool:
        """The gradients of every watched forward input are computed and no forward call
        went unwatched: the unit's backward is over."""
        return backward_is_done(self.fired, self.live, self.unwatched_calls)

    def end_backward(self) -> None:
        """Forget this backward's signals (the final callback; watches of forwards it did
        not reach stay live until their graphs are freed)."""
        self.fired = 0
        self.unwatched_calls = 0

    def forget(self) -> None:
        """Drop every watch, live ones too (``reset_iter_state``): they no longer count."""
        self.end_backward()
        self.live = 0
        self.epoch += 1

    # what one watch reports
    def watch_started(self) -> None:
        self.live += 1

    def watch_dropped(self) -> None:
        """A watched forward's graph was freed without a backward through it."""
        self.live -= 1

    def input_grads_ready(self) -> None:
        self.live -= 1
        self.fired += 1
        if self.on_done is not None:
            self.on_done()
