"""What a checkpoint path is, and verifying it: the one way every reader of a checkpoint
(``load``, ``fullshard ckpt inspect``, ``export``, ``export --hf``, the trainer's resume)
opens one.

Note [one verification path]
A reader calls ``open_checkpoint`` first and reads nothing of the directory before it
returns: it resolves ``latest``, classifies the directory (``Kind``), reads the manifest
(manifest.py: refused when damaged) and checks every file's size and checksum against
it, splitting the hashing across ranks when the read is collective. Each way a directory
can be wrong has its own one-line CheckpointError naming the file: a save that did not
finish, a directory that is no checkpoint, a damaged manifest, a file missing, cut short
or with other bytes. A checkpoint torch's DCP wrote has no manifest: it is opened
unverified, with an ``UnverifiedCheckpointWarning``, and ``Checkpoint.verified`` is
False. A directory whose manifest was lost is not mistaken for one: a fullshard save
marks DCP's own metadata (layout.WRITER_MARK) and always writes ``extra.pt``.
"""

from __future__ import annotations

import enum
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from . import checksums, manifest as manifests
from .layout import (EXTRA, LATEST, MANIFEST, METADATA, SHARD_SUFFIX, WRITER_MARK,
                     CheckpointError, being_rewritten, is_leftover, set_aside)

# A manifest being written; saves of older versions named it "fullshard.json.partial".
_MANIFEST_IN_FLIGHT = {os.path.basename(being_rewritten(MANIFEST)), f"{MANIFEST}.partial"}


class Kind(enum.Enum):
    FULLSHARD = "a complete fullshard checkpoint"
    UNFINISHED = "a save that did not finish"
    TORCH_DCP = "a torch DCP checkpoint without a manifest"
    NOT_A_CHECKPOINT = "not a checkpoint"


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint is read without checksums: torch's DCP wrote it, with no manifest."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory a reader may read: ``verified`` when every file matched its
    manifest; ``manifest`` is None for a torch DCP checkpoint (never verified)."""

    path: str
    kind: Kind
    manifest: dict | None
    verified: bool


def resolve(path: str | os.PathLike) -> str:
    """``path`` itself if it is a checkpoint, else the one its ``latest`` file names;
    ``path`` may also be that ``latest`` file."""
    path = os.path.abspath(os.fspath(path))
    if os.path.basename(path) == LATEST and os.path.isfile(path):
        path = os.path.dirname(path)
    pointer = os.path.join(path, LATEST)
    if os.path.exists(os.path.join(path, MANIFEST)) or not os.path.isfile(pointer):
        return path
    name = _name_in(pointer)
    target = os.path.join(path, name)
    named = bool(name) and os.path.basename(name) == name  # a directory beside ``latest``
    if named and not os.path.isdir(target) and os.path.isfile(
            os.path.join(set_aside(target), MANIFEST)):
        return set_aside(target)  # a save over ``name`` was killed between its renames
    if not named or not os.path.isdir(target):
        raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint in {path} "
                              "(deleted, damaged, or copied without it); name a step_N "
                              f"directory there, or write its name into {LATEST}")
    return target



def _name_in(pointer: str) -> str:
    """The checkpoint name a ``latest`` file holds; a CheckpointError when it holds none
    (bytes that are not text, or nothing), which would otherwise be reported as ''."""
    try:
        with open(pointer, "rb") as f:
            content = f.read()
    except OSError as err:
        raise CheckpointError(f"{pointer} cannot be read ({failure(err)}); make it readable, "
                              "or name a step_N directory beside it") from None
    try:
        name = content.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = ""
    if name and name.isprintable():
        return name
    raise CheckpointError(f"{pointer} does not hold a checkpoint's name (its {len(content)} "
                          "bytes are not a step_N name: overwritten or damaged); write the "
                          f"name of a step_N directory in {os.path.dirname(pointer)} into it, "
                          "or name that directory itself")

def classify(path: str) -> Kind:
    """What the directory ``path`` is (CheckpointError if there is none)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path}")
    names = set(os.listdir(path))
    if MANIFEST in names:
        return Kind.FULLSHARD
    if is_leftover(os.path.basename(path)) or EXTRA in names or names & _MANIFEST_IN_FLIGHT:
        return Kind.UNFINISHED
    if METADATA not in names:
        shards = any(n.endswith(SHARD_SUFFIX) for n in names)
        return Kind.UNFINISHED if shards else Kind.NOT_A_CHECKPOINT
    return Kind.UNFINISHED if WRITER_MARK in _writers(path) else Kind.TORCH_DCP


def _writers(path: str) -> list[str]:
    """The writers DCP's metadata records (layout.WRITER_MARK: a fullshard save)."""
    file = os.path.join(path, METADATA)
    try:
        metadata = FileSystemReader(path).read_metadata()
        modules = metadata.storage_meta.modules if metadata.storage_meta else []
        return [m for m in modules if isinstance(m, str)]
    except Exception as err:  # noqa: BLE001 - an unpickler fails in many ways
        raise CheckpointError(f"{file} cannot be read ({failure(err)}) and {path} has no "
                              f"{MANIFEST}: it is not a checkpoint fullshard or torch's DCP "
                              "can load") from None


def failure(err: BaseException) -> str:
    """``Type: first line of the message`` of what went wrong, for a one-line error; of
    the first rank's error where DCP wrapped it (its CheckpointException carries every
    rank's traceback)."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else 'no message'}"


def open_checkpoint(path: str | os.PathLike, *, verify: bool = True,
                    collective: bool = True) -> Checkpoint:
    """The checkpoint at ``path`` (resolved through ``latest``), verified against its
    manifest unless ``verify`` is False (Note [one verification path]). ``collective``:
    when a process group is up, every rank calls this and the hashing is split among
    them; readers on one process pass False."""
    path = resolve(path)
    kind = classify(path)
    if kind is Kind.UNFINISHED:
        names = os.listdir(path)  # without .metadata, DCP itself did not finish
        past_dcp = METADATA in names or EXTRA in names or is_leftover(os.path.basename(path))
        missing = MANIFEST if past_dcp else METADATA
        raise CheckpointError(
            f"{path} is not a complete checkpoint: {os.path.join(path, missing)} is missing "
            "(the save that wrote it did not finish, or the file was deleted). Load the "
            f"previous one, which '{LATEST}' in the parent directory names.")
    if kind is Kind.NOT_A_CHECKPOINT:
        raise CheckpointError(
            f"{path} is not a checkpoint: it holds neither {MANIFEST} (fullshard) nor "
            f"{METADATA} (torch DCP). Name a checkpoint directory (step_N), a directory whose "
            f"'{LATEST}' names one, or a fullshard train run's output directory.")
    if kind is Kind.TORCH_DCP:
        warnings.warn(f"{path} is a torch DCP checkpoint without fullshard's {MANIFEST}: "
                      "it is read unverified, with no checksums to catch a damaged file",
                      UnverifiedCheckpointWarning, stacklevel=3)
        return Checkpoint(path, kind, None, verified=False)
    manifest = manifests.read(path)
    if verify:
        verify_files(path, manifest["files"], collective=collective)
    return Checkpoint(path, kind, manifest, verified=verify)


def read_extra(checkpoint: Checkpoint) -> Any:
    """The ``extra`` a checkpoint was saved with (None for a torch DCP checkpoint)."""
    if checkpoint.manifest is None:
        return None
    return torch.load(os.path.join(checkpoint.path, EXTRA), weights_only=False)


def verified_extra(path: str | os.PathLike) -> Any:
    """The ``extra`` of the checkpoint at ``path``, having verified that file alone (the
    trainer asks which job saved its latest checkpoint before deciding to load it)."""
    checkpoint = open_checkpoint(path, verify=False)
    if checkpoint.manifest is not None:
        files = checkpoint.manifest["files"]
        verify_files(checkpoint.path, {EXTRA: files[EXTRA]} if EXTRA in files else files,
                     collective=False)
    return read_extra(checkpoint)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def verify_files(path: str, files: dict[str, dict], *, collective: bool = True) -> None:
    """Every file of ``files`` (the manifest's) has its size and checksum, else one
    CheckpointError naming each file that does not; collective when a process group is
    up and ``collective``: every rank hashes its share and learns every rank's verdict."""
    shared = collective and _distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if shared else (0, 1)
    problems = _unverifiable(path, files)  # every rank, before any collective
    if not problems:
        for name in sorted(files)[rank::world]:
            problem = _check_file(os.path.join(path, name), files[name])
            if problem:
                problems.append(problem)
    if shared:
        everyone: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(everyone, problems)
        problems = list(dict.fromkeys(p for part in everyone for p in part))
    if problems:
        raise CheckpointError("checkpoint failed verification: " + "; ".join(problems))


def _unverifiable(path: str, files: dict[str, dict]) -> list[str]:
    """Checksum kinds in the manifest that this installation cannot compute."""
    problems = []
    for algorithm in sorted({checksums.algorithm_of(e) for e in files.values()}):
        try:
            checksums.new_hasher(algorithm)
        except checksums.UnverifiableChecksum as err:
            problems.append(f"{path} cannot be checked here: {err}")
    return problems


def _check_file(full: str, expected: dict) -> str | None:
    """What is wrong with one file, or None."""
    if not os.path.isfile(full):
        return f"{full} is missing"
    size = os.path.getsize(full)
    if size != expected["bytes"]:
        return (f"{full} has {size} bytes, the manifest says {expected['bytes']} "
                "(truncated or overwritten)")
    algorithm = checksums.algorithm_of(expected)
    if checksums.file_digest(full, algorithm) != expected[algorithm]:
        return f"{full} is corrupt ({algorithm} differs from the manifest)"
    return None
