"""A checkpoint's manifest (``fullshard.json``): reading it, checking its shape, and the
checksum that guards the manifest itself.

The manifest vouches for every other file (checksums.py), so nothing vouches for it but
itself: since format 2 it carries ``self_checksum``, the checksum of its own content
(every other key, serialised canonically). A manifest damaged anywhere, even where the
damage leaves valid JSON (a digit of a size, a letter of a file name or of a digest), is
refused before any file it lists is trusted. Format 1 manifests (written before) have no
such checksum and are checked for their shape only.
"""

from __future__ import annotations

import json
import os
from typing import Any

from . import checksums
from .layout import MANIFEST, CheckpointError

FORMAT = 2
SELF_CHECKSUM = "self_checksum"
_KEYS = {1: {"format", "world_size", "files", "tensors", "has_optimizer"},
         2: {"format", "world_size", "files", "tensors", "has_optimizer", SELF_CHECKSUM}}


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _digest(body: dict, algorithm: str) -> str:
    hasher = checksums.new_hasher(algorithm)
    hasher.update(_canonical(body))
    return hasher.hexdigest()


def render(body: dict, algorithm: str) -> str:
    """The manifest file's text for ``body`` (format, world size, files, tensors, ...),
    with its own checksum added."""
    sealed = {**body, SELF_CHECKSUM: {algorithm: _digest(body, algorithm)}}
    return json.dumps(sealed, indent=1)


def read(path: str) -> dict:
    """The manifest of the checkpoint directory ``path``, checked; CheckpointError naming
    the file when it cannot be read, is not a manifest, or was damaged."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise _damaged(file, path, str(err).splitlines()[0]) from None
    problem = _shape_problem(manifest)
    if problem is None:
        try:
            problem = _self_checksum_problem(manifest)
        except checksums.UnverifiableChecksum as err:  # a later fullshard's checksum
            raise unverifiable(path, err) from None
    if problem is not None:
        raise _damaged(file, path, problem)
    return manifest


def unverifiable(path: str, err: checksums.UnverifiableChecksum) -> CheckpointError:
    return CheckpointError(f"checkpoint failed verification: {path} cannot be checked "
                           f"here: {err}")


def _damaged(file: str, path: str, why: str) -> CheckpointError:
    return CheckpointError(f"{file} is damaged ({why}), so no file of {path} can be "
                           "verified; load an earlier checkpoint, or restore the manifest "
                           "from a copy")


def _shape_problem(manifest: Any) -> str | None:
    """What makes ``manifest`` not a manifest of a format this fullshard reads, or None."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    version = manifest.get("format")
    if version not in _KEYS:
        return (f"format {version!r}, and this fullshard reads formats "
                f"{', '.join(map(str, _KEYS))}")
    keys = set(manifest)
    if keys != _KEYS[version] and keys != _KEYS[version] - {"has_optimizer"}:
        odd = sorted(keys ^ _KEYS[version])
        return f"keys {', '.join(odd)} missing or unexpected"
    world = manifest["world_size"]
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return f"world_size {world!r}"
    files = manifest["files"]
    if not isinstance(files, dict) or not files:
        return "no files listed"
    for name, entry in files.items():
        if os.path.basename(name) != name or name in ("", ".", ".."):
            return f"file name {name!r}"
        if not _is_file_entry(entry):
            return f"entry of {name} {entry!r}"
    tensors = manifest["tensors"]
    if not isinstance(tensors, dict) or not all(
            isinstance(t, dict) and isinstance(t.get("shape"), list) for t in tensors.values()):
        return "tensors are not shapes"
    if not isinstance(manifest.get("has_optimizer", False), bool):
        return f"has_optimizer {manifest['has_optimizer']!r}"
    return None


def _is_file_entry(entry: Any) -> bool:
    if not isinstance(entry, dict) or len(entry) != 2:
        return False
    size = entry.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return False
    return all(isinstance(v, str) for k, v in entry.items() if k != "bytes")


def _self_checksum_problem(manifest: dict) -> str | None:
    if manifest["format"] < 2:
        return None
    sealed = manifest[SELF_CHECKSUM]
    if not (isinstance(sealed, dict) and _is_file_entry({"bytes": 0, **sealed})):
        return f"{SELF_CHECKSUM} {sealed!r}"
    (algorithm, expected), = sealed.items()
    body = {k: v for k, v in manifest.items() if k != SELF_CHECKSUM}
    if _digest(body, algorithm) != expected:
        return f"its own {algorithm} differs from {SELF_CHECKSUM}"
    return None
