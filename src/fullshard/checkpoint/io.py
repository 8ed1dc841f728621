"""save / load: distributed checkpoints that commit atomically and reshard on load.

Layout of ``save("runs/x/step_000100", ...)``::

    runs/x/step_000100/      a torch.distributed.checkpoint (DCP) directory: .metadata
                             plus one shard file per rank, so torch's own DCP (and a
                             model sharded by PyTorch FSDP2) can load it
        extra.pt             the user's ``extra`` (step, RNG states, data position, ...)
        fullshard.json       the manifest: world size, every file's size and checksum
                             (checksums.py), every model tensor's shape and dtype
    runs/x/latest            the name of the newest complete checkpoint

Note [atomic commit]
Every rank writes into ``.step_000100.tmp`` beside the target, hashing each file as
it writes it (Note [checksums while writing]). Only after all ranks have finished
does rank 0 gather the checksums, write the manifest, rename the directory into
place, and finally rewrite ``latest`` (by rename, so it is never half written). A
save killed at any moment leaves either no new directory or an unreferenced temporary one: ``latest`` still names the previous
complete checkpoint. ``load`` reads nothing before the directory passed verification
(Note [one verification path]), which names the file that is missing or corrupt.
Resharding comes from DCP: shards are addressed by global offsets, so a checkpoint
saved at world size N loads at any M, or into a plain module on one process.
"""

from __future__ import annotations

import os
import shutil
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's own key layout

from ..core.guard.arrival import every_rank_arrives
from ..core.comm import note_collective
from ..core.features.native_state_dict import native_state_dict
from . import background, checksums, manifest as manifests, torch_dcp
from .agreement import dcp_failures, failed_ranks, on_every_rank
from .hashing_writer import HashingWriter, file_sizes, unrecorded
from .layout import (EXTRA, LATEST, MANIFEST, CheckpointError, being_rewritten, being_written,
                     set_aside)
from .mapped_reader import MappedReader
from .state_dict import (get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
                         set_optimizer_state_dict)
from .verify import Checkpoint, failure, open_checkpoint, read_extra, resolve


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if _distributed():
        dist.barrier(group=group)


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The state DCP saves or loads into: DTensors for sharded models, plain tensors for
    a plain module on one process (DCP reshards between the two)."""
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None, *, extra: Any = None,
         async_save: bool = False) -> "str | Future[str]":
    """Write a checkpoint of ``model`` (and ``optimizer``, and ``extra``) to ``path``.

    Every rank writes its own shards; the directory appears only once complete (see
    Note [atomic commit]) and ``latest`` in its parent then names it. Returns ``path``,
    or with ``async_save=True`` a future of it (Note [async save]). Collective: a save
    some ranks never call fails within the process group's timeout (or
    FULLSHARD_ARRIVAL_TIMEOUT seconds; Note [every rank arrives]), and a divergence still
    unnamed is named before anything is written.
    """
    if _distributed():
        every_rank_arrives("fullshard.checkpoint.save")
    background.wait_for_pending_save()
    path = os.path.abspath(os.fspath(path))
    state = _states(model, optimizer)
    meta = {"tensors": _describe(state["model"]), "has_optimizer": optimizer is not None}
    if not async_save:
        return _write_and_commit(path, state, extra, meta, group=None)
    staged = background.staged_copy(state)
    group = background.checkpoint_group()
    return background.submit(lambda: _write_and_commit(path, staged, extra, meta, group))


def _write_and_commit(path: str, state: dict[str, Any], extra: Any, meta: dict,
                      group: dist.ProcessGroup | None) -> str:
    parent, name = os.path.split(path)
    tmp = being_written(path)
    rank, world = _rank_world()

    def fresh_directory():
        if rank == 0:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save that died before committing
            os.makedirs(tmp)
    _save_step(fresh_directory, path, tmp, group)
    writer = HashingWriter(tmp, checksums.preferred())
    try:
        dcp.save(state, checkpoint_id=tmp, storage_writer=writer, process_group=group,
                 no_dist=not _distributed())
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        _save_failed(path, tmp, dcp_failures(err), group)  # DCP raised on every rank

    def write_extra():
        if rank == 0:
            with writer.fs.create_stream(os.path.join(tmp, EXTRA), "wb") as f:
                torch.save(extra, f)
    _save_step(write_extra, path, tmp, group)  # also: every file complete before listing
    files = _gather_checksums(tmp, writer.entries(), group)

    def commit():
        if rank == 0:
            body = {"format": manifests.FORMAT, "world_size": world, "files": files, **meta}
            _write_atomic(os.path.join(tmp, MANIFEST),
                          manifests.render(body, checksums.preferred()))
            _commit(tmp, path)
            _write_atomic(os.path.join(parent, LATEST), name)
    _save_step(commit, path, tmp, group)
    note_collective()  # DCP's and the gathers' collectives: Note [collectives settle before exit]
    return path


def _save_step(fn, path: str, tmp: str, group: dist.ProcessGroup | None) -> None:
    """``fn()``, a step some ranks take alone; a failure on any rank fails the save on
    every rank (Note [atomic commit]: nothing committed, ``latest`` unchanged)."""
    _, failed, _ = on_every_rank(fn, group)
    if failed:
        _save_failed(path, tmp, failed, group)


def _save_failed(path: str, tmp: str, failed: list[tuple[int, str]],
                 group: dist.ProcessGroup | None):
    rank, world = _rank_world()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the partial save: nothing left behind
    _barrier(group)  # every rank failed here too: it returns once the folder is gone
    raise CheckpointError(
        f"saving checkpoint {path} failed on {len(failed)} of {world} ranks "
        f"({failed_ranks(failed)}); nothing was committed and 'latest' still names the "
        "previous checkpoint. Check that the directory is writable and its disk has space, "
        "then save again.")


def load(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Load a checkpoint saved by :func:`save` at any world size into ``model`` (and
    ``optimizer``); returns the ``extra`` it was saved with. ``path`` may also be the
    parent directory, in which case its ``latest`` checkpoint is loaded.

    Every file is verified against the manifest first (Note [one verification path]). A
    checkpoint torch's DCP wrote (no manifest) loads too, unverified: an
    ``UnverifiedCheckpointWarning`` says so, and None is returned for ``extra``.
    Collective, like :func:`save`."""
    if _distributed():
        every_rank_arrives("fullshard.checkpoint.load")
    background.wait_for_pending_save()
    checkpoint = open_checkpoint(path)
    path = checkpoint.path
    reader = MappedReader(path)
    if checkpoint.manifest is not None:
        prefix, saved = torch_dcp.MODEL, checkpoint.manifest["tensors"]
        has_optimizer = checkpoint.manifest.get("has_optimizer", False)
    else:
        with native_state_dict():
            keys = list(model.state_dict())
        prefix = torch_dcp.model_prefix(reader.read_metadata(), keys)
        saved = torch_dcp.tensors(reader.read_metadata(), prefix)
        has_optimizer = torch_dcp.has_keys_under(reader.read_metadata(),
                                                 torch_dcp.optimizer_prefix(prefix))
    _check_fits(path, saved, model)
    if optimizer is not None and not has_optimizer:
        raise CheckpointError(f"checkpoint {path} holds no optimizer state; load the model "
                              "alone (optimizer=None) and start the optimizer fresh.")

    def prepare():
        model_state = get_model_state_dict(model)
        state = torch_dcp.nest(prefix, model_state)
        optim_state, unstepped = None, {}
        if optimizer is not None:
            optim_prefix = torch_dcp.optimizer_prefix(prefix)
            optim_state = get_optimizer_state_dict(model, optimizer)
            unstepped = _hold_back_unstepped(path, reader.read_metadata(), optim_prefix,
                                             optimizer, optim_state)
            torch_dcp.nest(optim_prefix, optim_state, into=state)
            _check_optimizer_fits(path, state, optim_prefix, reader.read_metadata())
        return state, model_state, optim_state, unstepped

    # What each rank decides alone is agreed on before the next collective: a rank that
    # failed alone would leave the others waiting in DCP's read or the first step.
    state, model_state, optim_state, unstepped = _load_step(prepare, path, "before reading")
    _read_into(checkpoint, state, reader)

    def adopt():
        set_model_state_dict(model, model_state)
        if optimizer is not None:
            optim_state["state"].update({name: held for name, (_, held) in unstepped.items()})
            set_optimizer_state_dict(model, optimizer, optim_state)
            for param, _ in unstepped.values():
                optimizer.state.pop(param, None)
    _load_step(adopt, path, "after reading (the model and optimizer may hold part of it)")
    note_collective()  # Note [collectives settle before exit]
    return read_extra(checkpoint)


def _load_step(fn, path: str, when: str):
    """``fn()``, a step each rank takes alone, whose failure on any rank raises on every
    rank: the rank's own CheckpointError where every rank raised the same one, else one
    naming each failed rank."""
    result, failed, error = on_every_rank(fn)
    if not failed:
        return result
    if isinstance(error, CheckpointError) and len(failed) == _rank_world()[1] \
            and all(text == failed[0][1] for _, text in failed):
        raise error  # every rank found the same: it is the whole story
    raise CheckpointError(f"loading checkpoint {path} failed {when} on {len(failed)} of "
                          f"{_rank_world()[1]} ranks ({failed_ranks(failed)}); every rank "
                          "stops here. Fix what the failed ranks name and load again.")


def _read_into(checkpoint: Checkpoint, state: dict[str, Any], reader: dcp.FileSystemReader,
               collective: bool = True) -> None:
    """DCP's load of ``state`` (``collective``: by every rank of the process group, if
    one is up). Verified files are read as they are; an unverified checkpoint's failure
    is named in one line (nothing vouched for its files)."""
    with warnings.catch_warnings():  # DCP: "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, checkpoint_id=checkpoint.path, storage_reader=reader,
                     no_dist=not (collective and _distributed()))
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            if checkpoint.verified:
                raise
            raise CheckpointError(
                f"torch DCP checkpoint {checkpoint.path} could not be read ({failure(err)}); "
                f"it has no {MANIFEST} to tell which of its files is damaged") from None


def read_manifest(path: str | os.PathLike) -> dict | None:
    """The manifest of the checkpoint at ``path``, checked but without verifying the
    files (None for a checkpoint torch's DCP wrote, which has none)."""
    return open_checkpoint(path, verify=False, collective=False).manifest


def _describe(model_state: dict[str, Any]) -> dict[str, dict]:
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
            for k, v in model_state.items() if isinstance(v, torch.Tensor)}


def _check_fits(path: str, saved: dict[str, dict], model: nn.Module) -> None:
    """Name missing and unexpected keys and shape mismatches before reading anything."""
    with native_state_dict():  # shapes only: never gather an FSDP1 model's full state dict
        current = _describe(model.state_dict())
    missing = sorted(current.keys() - saved.keys())
    unexpected = sorted(saved.keys() - current.keys())
    mismatched = [f"{k}: checkpoint {tuple(saved[k]['shape'])}, model {tuple(v['shape'])}"
                  for k, v in current.items() if k in saved and saved[k]["shape"] != v["shape"]]
    if missing or unexpected or mismatched:
        raise CheckpointError(f"checkpoint {path} does not fit this model: "
                              + _misfit(missing, mismatched, unexpected))


def _misfit(missing: list[str], mismatched: list[str], unexpected: list[str] = (),
            limit: int | None = None) -> str:
    """What does not fit, one part per kind; each list cut at ``limit`` entries."""
    def shown(items: list[str], sep: str) -> str:
        if limit is None or len(items) <= limit:
            return sep.join(items)
        return sep.join(items[:limit]) + f" and {len(items) - limit} more"

    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {shown(missing, ', ')}")
    if unexpected:
        parts.append(f"in the checkpoint but not the model: {shown(unexpected, ', ')}")
    if mismatched:
        parts.append(f"shape mismatches: {shown(mismatched, '; ')}")
    return " | ".join(parts)


def _check_optimizer_fits(path: str, state: dict[str, Any], prefix: str, metadata: Any
                          ) -> None:
    """Every optimizer value the load will ask for (its keys begin with ``prefix``) is in
    the checkpoint with its shape, so that DCP cannot fail halfway: a load that raises
    here has changed nothing."""
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    missing, mismatched = [], []
    for key, value in flat.items():
        if not key.startswith(prefix):
            continue
        entry = saved.get(key)
        if entry is None:
            missing.append(key)
        elif isinstance(value, torch.Tensor) and tuple(getattr(entry, "size", value.shape)) \
                != tuple(value.shape):
            mismatched.append(f"{key}: checkpoint {tuple(entry.size)}, optimizer "
                              f"{tuple(value.shape)}")
    if missing or mismatched:
        raise CheckpointError(
            f"checkpoint {path} does not fit this optimizer "
            f"({_misfit(missing, mismatched, limit=5)}): it was "
            "saved with another optimizer or other settings. Build the optimizer it was "
            "saved with, or load the model alone (optimizer=None) and start the optimizer "
            "fresh. Nothing was loaded.")


def _hold_back_unstepped(path: str, metadata: Any, prefix: str, optimizer: torch.optim.Optimizer,
                         optim_state: dict[str, Any]) -> dict[str, tuple[torch.Tensor, dict]]:
    """The parameters the saved optimizer held but had not stepped (no gradient had reached
    them yet: an expert no token was routed to, a branch not taken) have no state in the
    checkpoint; torch's ``get_optimizer_state_dict`` gives the fresh optimizer one for
    every parameter. Those are taken out of ``optim_state`` (not read), by name -> (the
    parameter, its fresh state), so that the load leaves them without state, as the saved
    optimizer had them and as ``Optimizer.load_state_dict`` would in one process. Only
    where the saved param groups name the same settings (the same kind of optimizer) and
    list the parameter: otherwise its entry stays, and the fit check names it as missing."""
    names = torch_dcp.stateless(metadata, prefix, optim_state["state"])
    if not names or torch_dcp.saved_group_keys(metadata, prefix) != [
            set(group) for group in optim_state["param_groups"]]:
        return {}
    listed = torch_dcp.saved_parameter_names(path, metadata, prefix)
    params = {name: p for group, names_in_group in zip(optimizer.param_groups,
                                                       optim_state["param_groups"])
              for p, name in zip(group["params"], names_in_group["params"])}
    return {name: (params[name], optim_state["state"].pop(name))
            for name in names if name in listed and name in params}


def _gather_checksums(directory: str, written: dict[str, dict],
                      group: dist.ProcessGroup | None = None) -> dict[str, dict]:
    """Every file's manifest entry: each rank's files as hashed while written, plus any
    file no rank could vouch for, hashed by reading it back (split across ranks)."""
    rank, world = _rank_world()
    # Listed before the gather, which no rank leaves before every rank has listed: rank 0
    # writes the manifest into this directory right after, and renames it.
    sizes = file_sizes(directory)
    entries = dict(written)
    if _distributed():
        gathered: list[dict] = [{} for _ in range(world)]
        dist.all_gather_object(gathered, written, group=group)
        entries = {k: v for part in gathered for k, v in part.items()}
    rest = unrecorded(sizes, entries)  # the same on every rank
    if not rest:
        return entries
    algorithm = checksums.preferred()
    mine = {n: checksums.file_entry(os.path.join(directory, n), algorithm)
            for n in rest[rank::world]}
    if _distributed():
        read_back: list[dict] = [{} for _ in range(world)]
        dist.all_gather_object(read_back, mine, group=group)
        mine = {k: v for part in read_back for k, v in part.items()}
    return {**entries, **mine}


def _write_atomic(path: str, text: str) -> None:
    tmp = being_rewritten(path)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _commit(tmp: str, path: str) -> None:
    old = set_aside(path)
    if os.path.exists(path):  # saving over an older checkpoint of the same name
        # Between these two renames ``path`` is missing; resolve() then finds the older
        # checkpoint set aside, so a process killed here leaves ``latest`` loadable.
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
    else:
        os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)  # also one a process killed in between left


__all__ = ["save", "load", "resolve", "read_manifest", "CheckpointError", "EXTRA", "LATEST",
           "MANIFEST"]
