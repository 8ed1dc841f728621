"""The files of a checkpoint directory, and the error every reader raises about them.

    step_000100/
        .metadata          torch DCP's index of every tensor's pieces
        __R_0.distcp       rank R's shards (DCP)
        extra.pt           the user's ``extra``
        fullshard.json     the manifest: every file's size and checksum (manifest.py)
    latest                 beside the checkpoints: the name of the newest complete one
    .step_000100.tmp       a save being written (renamed to step_000100 once complete)
    .step_000100.replaced  the older step_000100 a save over the same name set aside
    .step_000100.deleting  a checkpoint the trainer prunes, on its way out
    .latest.partial        ``latest`` (or a manifest) being rewritten, renamed over it

Everything in flight is a hidden sibling named here: no listing of ``step_*`` or of the
visible names ever shows half a save, and ``is_leftover`` tells what a kill left behind.
"""

from __future__ import annotations

import os
import re

MANIFEST = "fullshard.json"
EXTRA = "extra.pt"
LATEST = "latest"
METADATA = ".metadata"  # torch DCP's name for it
SHARD_SUFFIX = ".distcp"
# What a fullshard save writes into DCP's metadata (StorageMeta.modules): a directory whose
# .metadata carries it but that has no manifest is a fullshard checkpoint that lost it,
# never a checkpoint torch's DCP wrote, so it is refused rather than loaded unverified.
WRITER_MARK = "fullshard"


_IN_FLIGHT = ("tmp", "replaced", "deleting", "partial")
_LEFTOVER = re.compile(rf"^\..+\.({'|'.join(_IN_FLIGHT)})$")


def _hidden(path: str, state: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{state}")


def being_written(path: str) -> str:
    """Where a save of checkpoint ``path`` writes until it commits by renaming."""
    return _hidden(path, "tmp")


def set_aside(path: str) -> str:
    """Where a save over an existing checkpoint ``path`` moves the older one while it
    commits."""
    return _hidden(path, "replaced")


def being_deleted(path: str) -> str:
    """Where the trainer moves checkpoint ``path`` before deleting it."""
    return _hidden(path, "deleting")


def being_rewritten(path: str) -> str:
    """Where a file (``latest``, a manifest) is written before it replaces ``path``."""
    return _hidden(path, "partial")


def is_leftover(name: str, state: str | None = None) -> bool:
    """Whether ``name`` is one of the hidden names above (of ``state``: "tmp",
    "replaced", "deleting" or "partial", if given): something in flight, or what a
    process killed in flight left."""
    found = _LEFTOVER.match(name)
    return found is not None and state in (None, found[1])


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, or does not fit the model."""
