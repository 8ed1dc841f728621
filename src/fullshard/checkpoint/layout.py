"""The files of a checkpoint directory, and the error every reader raises about them.

    step_000100/
        .metadata          torch DCP's index of every tensor's pieces
        __R_0.distcp       rank R's shards (DCP)
        extra.pt           the user's ``extra``
        fullshard.json     the manifest: every file's size and checksum (manifest.py)
    latest                 beside the checkpoints: the name of the newest complete one
"""

from __future__ import annotations

MANIFEST = "fullshard.json"
EXTRA = "extra.pt"
LATEST = "latest"
METADATA = ".metadata"  # torch DCP's name for it
SHARD_SUFFIX = ".distcp"
# What a fullshard save writes into DCP's metadata (StorageMeta.modules): a directory whose
# .metadata carries it but that has no manifest is a fullshard checkpoint that lost it,
# never a checkpoint torch's DCP wrote, so it is refused rather than loaded unverified.
WRITER_MARK = "fullshard"


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupt, or does not fit the model."""
