"""The files of a checkpoint directory, and the error every reader raises about them.

    step_000100/
        .metadata          torch DCP's index of every tensor's pieces
        __R_0.distcp       rank R's shards (DCP)
        extra.pt           the user's ``extra``
        fullshard.json     the manifest: every file's size and checksum (manifest.py)
    latest                 beside the checkpoints: the name of the newest complete one
    .step_000100.tmp       a save being written (renamed to step_000100 once complete)
    .step_000100.replaced  the older step_000100 a save over the same name set aside
"""

from __future__ import annotations

import os

MANIFEST = "fullshard.json"
EXTRA = "extra.pt"
LATEST = "latest"
METADATA = ".metadata"  # torch DCP's name for it
SHARD_SUFFIX = ".distcp"
# What a fullshard save writes into DCP's metadata (StorageMeta.modules): a directory whose
# .metadata carries it but that has no manifest is a fullshard checkpoint that lost it,
# never a checkpoint torch's DCP wrote, so it is refused rather than loaded unverified.
WRITER_MARK = "fullshard"


def set_aside(path: str) -> str:
    """Where a save over an existing checkpoint ``path`` moves the older one while it
    commits: a hidden sibling, so that no listing of step_N names ever shows it."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.replaced")


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, or does not fit the model."""
