"""Fault injection for the trainer's tests: a worker dies at an exact point of a run.

    FULLSHARD_TEST_KILL_AT_STEP=K   rank 1 sends itself SIGKILL as step K starts
    FULLSHARD_TEST_KILL_IN_SAVE=K   rank 0 dies inside the save of step K's checkpoint,
                                    after every rank has written its shards and before
                                    the save commits (see fullshard.checkpoint.save)

A test runs ``fullshard train`` with :func:`environment`: this directory on PYTHONPATH
and one variable set. Python imports ``sitecustomize`` when any process starts; in
torchrun's workers (``LOCAL_RANK`` set) with a variable set, this one wraps the
trainer's functions at that point. Both faults fire on a job's first attempt only
(TORCHELASTIC_RESTART_COUNT 0), so the workers torchrun restarts run through. Tests
import this file as ``faults.sitecustomize`` for the names, which installs nothing.
"""

from __future__ import annotations

import os
import signal

KILL_AT_STEP = "FULLSHARD_TEST_KILL_AT_STEP"
KILL_IN_SAVE = "FULLSHARD_TEST_KILL_IN_SAVE"
HERE = os.path.dirname(os.path.abspath(__file__))


def environment(variable: str, step: int) -> dict[str, str]:
    """Environment entries that arm fault ``variable`` at ``step`` in a ``fullshard
    train`` subprocess (to add to its environment)."""
    path = [HERE, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), variable: str(step)}


def _armed(variable: str, step: int) -> bool:
    from fullshard.train.launch import restart_count

    value = os.environ.get(variable)
    return value is not None and int(value) == step and restart_count() == 0


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _DiesWhenPickled:
    """Rank 0 pickles a checkpoint's ``extra`` into the save's temporary directory once
    every rank's shards are written, before the manifest, the rename and ``latest``."""

    def __reduce__(self):
        _die()


def _kill_at_step_start() -> None:
    """Rank 1 dies as step K starts: the trainer begins a step's memory tracking first
    thing after counting the step."""
    import torch.distributed as dist
    from fullshard.train.metrics import StepMemory

    begin_step = StepMemory.begin_step

    def wrapped(self, step: int) -> None:
        if dist.get_rank() == 1 and _armed(KILL_AT_STEP, step):
            _die()
        begin_step(self, step)

    StepMemory.begin_step = wrapped


def _kill_in_save() -> None:
    """Rank 0 dies inside step K's save: its checkpoint ``extra`` gets an entry that
    kills the process when pickled."""
    import torch.distributed as dist
    from fullshard import checkpoint

    save = checkpoint.save

    def wrapped(*args, extra=None, **kwargs):
        if (dist.get_rank() == 0 and isinstance(extra, dict)
                and _armed(KILL_IN_SAVE, extra.get("step"))):
            extra = {**extra, "fault": _DiesWhenPickled()}
        return save(*args, extra=extra, **kwargs)

    checkpoint.save = wrapped


def install() -> None:
    if "LOCAL_RANK" not in os.environ:  # not a worker: the launcher, the test itself
        return
    if KILL_AT_STEP in os.environ:
        _kill_at_step_start()
    if KILL_IN_SAVE in os.environ:
        _kill_in_save()


if __name__ == "sitecustomize":
    install()
