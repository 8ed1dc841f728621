"""The calls of an optimizer's step: which call is the outermost, and the step run alone.

Note [the calls of an optimizer step]
fullshard's step hooks (Note [optimizer steps on local shards]) swap an optimizer's
parameters for their local shards in the pre-hook and back in the post-hook. Three things
about the calls of ``step()`` are decided here, with torch's public surface only (no
walking of Python frames, no unwrapping of the step torch wraps), so that they hold on
every torch fullshard supports.

Nested calls. torch wraps each optimizer class's ``step`` with the hooks when the class is
first built, so a subclass whose ``step`` calls ``super().step()`` fires the hooks twice,
one pair inside the other. Only the outermost pair swaps. The hooks keep an open-call
record per optimizer (the thread and the depth): a pre-hook that finds its optimizer open
on its own thread is nested and stands aside, and so does the post-hook that closes it.

A step that raises. torch calls the post-hooks after the step returns, with no
``try/finally``: a step that raises never closes its record nor undoes its swap. The
optimizer would then hold local tensors (a state dict saved in the handler would hold
plain tensors), and the next step would pass for a nested one and step stale gradients.
No hook sees the exception; only code around the call does. So the first step of an
optimizer over fullshard parameters installs a guard as its ``step`` (an instance
attribute, as torch's LR schedulers install theirs; it calls whatever ``step`` was there),
and the guard undoes the swap and closes the record before an exception leaves ``step()``.
On entry it also clears a record a raising call left outside it: the very first step,
which runs before the guard exists (if it raises, the optimizer holds local tensors until
its next step), or a call through the class (``type(opt).step(opt)``). Weighed and
rejected: a generation count bumped by forward and backward (a step retried at once, after
a hook's error, sees the same count) and a token that lives as long as the call's frame (a
traceback the caller keeps, as ``pytest.raises`` or a logger does, keeps the frame and the
token alive).

The step alone. A whole-matrix step in rounds, a disk step in chunks and the host thread's
step of a unit each run the optimizer's own step several times within one ``step()``; the
hooks, the user's and fullshard's, run once around the whole. The step runs on a copy of the
optimizer made by the copy protocol (``Optimizer.__getstate__`` hands over ``defaults``,
``state`` and ``param_groups``, the same objects, and ``__setstate__`` gives the copy empty
per-optimizer hook registries), carrying the other attributes of the original (a subclass's
own, a GradScaler's flags); fullshard's hooks stand aside for such copies. What torch
offers no public way to skip: a hook the user registered for every optimizer
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) runs on the copy too, once per
round, chunk or unit. torch keeps those in a private module dict, and emptying it for the
call would also silence them, fullshard's included, for a step another thread runs meanwhile
(the host thread steps while the main thread trains on), so fullshard leaves them be.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Callable

import torch

# Per optimizer, the step call open on it: the hooks of calls inside it stand aside.
# Keyed weakly: this module must not keep a user's optimizer alive.
_OPEN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _OpenCall]" = \
    weakref.WeakKeyDictionary()
# Copies made by step_alone, for the length of their step: fullshard's hooks stand aside.
_ALONE: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
# Optimizers whose ``step`` fullshard has guarded.
_GUARDED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


class _OpenCall:
    """The outermost step call running on an optimizer: its thread and how deep the
    calls inside it (``super().step()``) go."""

    __slots__ = ("thread", "depth")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.depth = 1


def enter(opt: torch.optim.Optimizer) -> bool:
    """Note that a step of ``opt`` starts (its pre-hook); True for the outermost call,
    False for a call inside a step of ``opt`` running on this thread."""
    call = _OPEN.get(opt)
    if call is not None and call.thread == threading.get_ident():
        call.depth += 1
        return False
    _OPEN[opt] = _OpenCall()  # another thread's record: its step raised there
    return True


def leave(opt: torch.optim.Optimizer) -> bool:
    """Note that a step of ``opt`` ends (its post-hook); True when the outermost ends."""
    call = _OPEN.get(opt)
    if call is None or call.thread != threading.get_ident():
        return True
    call.depth -= 1
    if call.depth:
        return False
    del _OPEN[opt]
    return True


def is_alone(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` is a copy ``step_alone`` is stepping (the hooks have nothing to do)."""
    return opt in _ALONE


def step_alone(opt: torch.optim.Optimizer) -> None:
    """``opt``'s own step over what its ``param_groups`` hold now, without its hooks or
    fullshard's (Note [the calls of an optimizer step], "The step alone")."""
    alone = copy.copy(opt)  # shares defaults, state and param_groups; no hooks of its own
    for name, value in opt.__dict__.items():
        if name != "step":  # a step installed on the instance belongs to ``opt``
            alone.__dict__.setdefault(name, value)
    _ALONE.add(alone)
    type(alone).step(alone)


def guard(opt: torch.optim.Optimizer, undo: Callable[[torch.optim.Optimizer], None]) -> None:
    """Install ``opt``'s step guard once (Note [the calls of an optimizer step], "A step
    that raises"): ``undo(opt)`` puts back what an unfinished step left."""
    if opt in _GUARDED:
        return
    _GUARDED.add(opt)
    opt.step = _GuardedStep(opt, opt.__dict__.get("step"), undo)


class _GuardedStep:
    """``opt.step`` once fullshard guards it: the step that was there (torch's, or a
    wrapper an LR scheduler installed), with what a raising call leaves undone."""

    def __init__(self, opt, previous, undo) -> None:
        self._opt = weakref.ref(opt)  # opt holds this object: no cycle to keep it alive
        self._previous = previous
        self._undo = undo
        self._running = threading.local()

    def __call__(self, *args, **kwargs):
        opt = self._opt()
        if getattr(self._running, "on", False):  # a hook calling opt.step(): covered
            return self._step(opt, args, kwargs)
        self._abandon(opt)  # left by a call that raised outside the guard
        self._running.on = True
        try:
            return self._step(opt, args, kwargs)
        except BaseException:
            self._abandon(opt)
            raise
        finally:
            self._running.on = False

    def _step(self, opt, args, kwargs):
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return type(opt).step(opt, *args, **kwargs)

    def _abandon(self, opt) -> None:
        if _OPEN.pop(opt, None) is not None:
            self._undo(opt)

    @property
    def __func__(self):
        # LR schedulers built later wrap ``opt.step.__func__`` and bind it to the
        # optimizer: hand them a function that goes through this guard
        def step(_opt, *args, **kwargs):
            return self(*args, **kwargs)
        return step

    def __getattr__(self, name: str):
        # what the wrapped step carries (an LR scheduler checks for its own mark)
        if name.startswith("__") or name in ("_opt", "_previous", "_undo", "_running"):
            raise AttributeError(name)
        opt = self._opt()
        step = self._previous if self._previous is not None else type(opt).step
        return getattr(step, name)
