"""Fault injection for the trainer's tests: a worker dies at an exact point of a run.

    FULLSHARD_TEST_KILL_AT_STEP=K   rank 1 sends itself SIGKILL as step K starts
    FULLSHARD_TEST_KILL_IN_SAVE=K   rank 0 dies inside the save of step K's checkpoint,
                                    after every rank has written its shards and before
                                    the save commits (see checkpoints.save)

Both fire on a job's first attempt only (TORCHELASTIC_RESTART_COUNT 0), so the workers
torchrun restarts run through. These are test hooks, not features: with the variables
unset nothing here does anything.
"""

from __future__ import annotations

import os
import signal

from .launch import restart_count

KILL_AT_STEP = "FULLSHARD_TEST_KILL_AT_STEP"
KILL_IN_SAVE = "FULLSHARD_TEST_KILL_IN_SAVE"


def _armed(variable: str, step: int) -> bool:
    value = os.environ.get(variable)
    return value is not None and int(value) == step and restart_count() == 0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def at_step_start(step: int, rank: int) -> None:
    if rank == 1 and _armed(KILL_AT_STEP, step):
        _die()


class _DiesWhenPickled:
    """Rank 0 pickles a checkpoint's ``extra`` into the save's temporary directory once
    every rank's shards are written, before the manifest, the rename and ``latest``."""

    def __reduce__(self):
        _die()


def in_save_extra(step: int, rank: int) -> dict:
    """Entries to add to step ``step``'s checkpoint ``extra`` (none unless armed)."""
    if rank == 0 and _armed(KILL_IN_SAVE, step):
        return {"fault": _DiesWhenPickled()}
    return {}
