"""``--resume`` in a run whose ``OUT/checkpoints/latest`` is missing or not a file: the
newest ``step_N`` beside it that verifies becomes the one ``latest`` names.

``latest`` is rewritten only after each checkpoint commits, so losing it (deleted by
hand, a directory created in its place, a copy that left it out) leaves the complete
checkpoints beside it intact: starting from step 0 over them would throw them away.
"""

from __future__ import annotations

import os
import uuid

from ..checkpoint.layout import LATEST, CheckpointError
from ..checkpoint.verify import open_checkpoint
from .config.schema import ConfigError

MOVED_SUFFIX = ".directory"  # where a directory named ``latest`` is moved out of the way


def point_latest_at_newest(directory: str, pattern) -> str | None:
    """When ``directory/latest`` is not a file, write into it the newest checkpoint of
    ``directory`` whose name matches ``pattern`` and that verifies, and return the line
    that says so; None when ``latest`` is a file (it decides). ConfigError when no
    checkpoint verifies (naming them), or there is none."""
    pointer = os.path.join(directory, LATEST)
    if os.path.isfile(pointer):
        return None
    names = sorted((n for n in os.listdir(directory) if pattern.match(n)), reverse=True) \
        if os.path.isdir(directory) else []
    why = "a directory" if os.path.isdir(pointer) else "missing"
    if not names:
        raise ConfigError(f"--resume: no checkpoint in {directory}; run without --resume "
                          "to start there")
    newest = next((n for n in names if _verifies(os.path.join(directory, n))), None)
    if newest is None:
        raise ConfigError(f"--resume: {pointer} is {why} and none of {', '.join(names)} there "
                          f"verifies (fullshard ckpt inspect {directory}/STEP says why); "
                          "restore a checkpoint, or run without --resume to start over")
    moved = _move_directory_aside(pointer) if why == "a directory" else ""
    _write_pointer(pointer, newest)
    return (f"--resume: {pointer} is {why}{moved}; resuming from {newest}, the newest "
            "checkpoint there that verifies (latest now names it)")


def _verifies(path: str) -> bool:
    try:
        open_checkpoint(path, collective=False)  # every file against its manifest
    except CheckpointError:
        return False
    return True


def _move_directory_aside(pointer: str) -> str:
    """Move the directory named ``latest`` to ``latest.directory`` (the name saves
    rewrite as a file); what to tell of it."""
    target = pointer + MOVED_SUFFIX
    try:
        os.replace(pointer, target)
    except FileNotFoundError:  # another process of this launch moved it first
        pass
    return f" (moved to {target})"


def _write_pointer(pointer: str, name: str) -> None:
    # a name of its own: every process of a launch may write the same content at once
    tmp = f"{pointer}.{uuid.uuid4().hex}.partial"
    with open(tmp, "w") as f:
        f.write(name)
    os.replace(tmp, pointer)
