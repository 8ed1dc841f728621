"""A run's checkpoints: ``OUT/checkpoints/step_NNNNNN`` through ``fullshard.checkpoint``
(atomic, verified, reshardable), ``OUT/checkpoints/latest`` naming the newest.

Besides the model and the optimizer, a checkpoint's ``extra`` holds what else decides
the steps after it: the step, the data position (Note [epochs of disjoint windows]),
every rank's RNG state (dropout in Hugging Face models), the fp16 loss scaler, and the
torchrun job that saved it (Note [restarts], below).

Every save first checks that every rank sees the files rank 0 writes in
``OUT/checkpoints`` (``check_shared``): a node saving to a directory of its own would
leave its shards where the commit never looks, so a run whose ``--out`` is not shared by
every node stops at its first save, on every rank, before anything is committed.

One job writes a run directory at a time: rank 0 holds an exclusive lock on
``OUT/.lock`` (``hold_run``) from before the first write to the end of its process, and
a second ``fullshard train`` on the same ``--out`` stops at once, on every rank, naming
the process and job that hold it. The lock is the operating system's (``flock``): it
goes with the process that held it, so a killed run never leaves a stale one behind,
and a restarted attempt takes it again. On a network filesystem it holds where the
filesystem supports ``flock`` (NFSv4, Lustre and GPFS do; an NFSv3 mount without lockd
does not).

Restarts under ``--max-restarts``: which attempt a worker is, and where it continues.

Note [restarts]
When a worker fails, torchrun stops every worker of the job and, up to ``--max-restarts``
times, starts them all again with the same command line, on every node (the attempt and
the job as the workers agree on them: Note [restarts across nodes]). A restarted worker
resumes from the latest checkpoint in --out when this job wrote it (checkpoints record
the job's id), exactly as --resume would, so the run ends with the weights of an
uninterrupted one; a job that failed before its first checkpoint starts again from
scratch. Each ``fullshard train`` launch is a job of its own (workers started by another
torchrun take its TORCHELASTIC_RUN_ID, "none" unless --rdzv-id names one).

A run stopped on a non-finite loss would diverge again from the same checkpoint, every
restart: rank 0 leaves OUT/diverged naming the job and the error, and restarted workers
of that job repeat the error and exit instead of training.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import checkpoint
from ..checkpoint.agreement import on_every_rank
from ..checkpoint.layout import being_deleted, is_leftover
from ..checkpoint.verify import verified_extra
from .launch.agreement import counted
from .config.schema import ConfigError, TrainConfig
from .config.flags import load_toml
from .launch.launcher import job_id, restart_count

STEP_DIR = re.compile(r"^step_(\d+)$")
RUN_CONFIG = "config.toml"  # the resolved configuration, written by the loop at start
# How long a rank looks for rank 0's probe file before it calls --out unshared: a network
# filesystem may show another node's new file a moment late.
SHARED_WAIT_S = 3.0


@dataclass
class ResumePoint:
    step: int
    data_position: dict
    scaler: dict | None


def checkpoint_dir(out: str) -> str:
    return os.path.join(out, "checkpoints")


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save(out: str, step: int, model: nn.Module, optimizer: list[torch.optim.Optimizer],
         data_position: dict, scaler: Any, device: torch.device, keep: int) -> str:
    """Save step ``step`` on every rank (collective); rank 0 then deletes all but the
    ``keep`` newest."""
    check_shared(out)
    rng_states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rng_states, _rng_state(device))
    extra = {"step": step, "data": data_position, "rng": rng_states,
             "scaler": scaler.state_dict() if scaler is not None else None, "job": job_id()}
    path = checkpoint.save(os.path.join(checkpoint_dir(out), f"step_{step:06d}"), model,
                           optimizer, extra=extra)
    if dist.get_rank() == 0:
        _prune(checkpoint_dir(out), keep)
    return path


LOCK_FILE = ".lock"
# The lock file this process holds on its run directory, open until the process exits
# (Note above: the operating system releases it then). Process-wide: one run per process.
_held_lock = None


def hold_run(out: str) -> None:
    """Collective: rank 0 takes the run directory's lock, or every rank raises a
    ConfigError naming who holds it (one job writes a run directory at a time)."""
    global _held_lock
    holder = None
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        lock = open(os.path.join(out, LOCK_FILE), "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "{}"
            lock.close()
        else:
            lock.truncate(0)
            lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                   "job": job_id(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
            lock.flush()
            _held_lock = lock
    found = [holder]
    dist.broadcast_object_list(found)
    if found[0] is not None:
        try:
            who = json.loads(found[0])
        except ValueError:
            who = {}
        raise ConfigError(
            f"--out {out}: another fullshard train is writing this run (pid "
            f"{who.get('pid', '?')} on {who.get('host', '?')}, job {who.get('job', '?')}, "
            f"since {who.get('since', '?')}); wait for it to end or stop it, or give "
            "another --out")


def check_shared(out: str) -> None:
    """Collective: every rank sees the file rank 0 writes in ``OUT/checkpoints``, so the
    shards every rank writes there end up in one checkpoint; else ConfigError on every
    rank, naming the ranks that do not."""
    directory = checkpoint_dir(out)
    name = [f".shared-{uuid.uuid4().hex}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name)
    probe = os.path.join(directory, name[0])

    def write_probe() -> None:
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
            with open(probe, "w") as f:
                f.write(name[0])
    _, failed, _ = on_every_rank(write_probe)  # every rank hears of rank 0's failure
    if failed:
        raise ConfigError(
            f"--out {out}: cannot write in {directory} ({failed[0][1]}); checkpoints are "
            "saved there: make it a writable directory with free space, or give another --out")
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, _appears(probe, name[0]))
    if dist.get_rank() == 0:  # every rank has looked
        os.remove(probe)
    blind = [rank for rank, saw in enumerate(seen) if not saw]
    if blind:
        raise ConfigError(
            f"--out {out}: {counted('rank', blind)} cannot see the files rank 0 writes in "
            f"{directory} (a checkpoint would miss their shards); every node must save to "
            "one shared directory (a network filesystem mounted on each): point --out at one")


def _appears(path: str, content: str) -> bool:
    deadline = time.monotonic() + SHARED_WAIT_S
    while True:
        try:
            with open(path) as f:
                if f.read() == content:
                    return True
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _prune(directory: str, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints. Each is renamed out of the way
    first: a process killed while deleting leaves a hidden ``.step_N.deleting`` (removed
    by the next prune), never a step_N with some of its files gone."""
    names = os.listdir(directory)
    steps = sorted(name for name in names if STEP_DIR.match(name))
    # Also an older step_N a save over step_N set aside and was killed before removing,
    # even with no step_N beside it (a run resumed from it): this prune follows a commit,
    # so ``latest`` names a newer checkpoint and nothing reads the set-aside one again.
    doomed = [os.path.join(directory, name) for name in names
              if is_leftover(name, "deleting") or is_leftover(name, "replaced")]
    for name in steps[:-keep]:
        gone = being_deleted(os.path.join(directory, name))
        os.replace(os.path.join(directory, name), gone)
        doomed.append(gone)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def has_checkpoint(out: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir(out), checkpoint.io.LATEST))


def latest_name(out: str) -> str | None:
    """The name ``latest`` holds (e.g. ``step_000040``), or None before the first save."""
    if not has_checkpoint(out):
        return None
    with open(os.path.join(checkpoint_dir(out), checkpoint.io.LATEST)) as f:
        return f.read().strip()


def saved_job(out: str) -> str | None:
    """The torchrun job id the latest checkpoint in ``out`` was saved by (None: unknown)."""
    extra = verified_extra(checkpoint_dir(out))  # Note [one verification path]
    return extra.get("job") if isinstance(extra, dict) else None


def resolve_checkpoint(path: str) -> str:
    """The checkpoint a person names: a checkpoint directory, a directory whose ``latest``
    names one, that ``latest`` file, or a run's OUT (its ``checkpoints/latest``)."""
    if os.path.isdir(checkpoint_dir(path)) and not os.path.exists(
            os.path.join(path, checkpoint.io.MANIFEST)):
        path = checkpoint_dir(path)
    return checkpoint.io.resolve(path)


def run_of(checkpoint_path: str) -> str | None:
    """The run directory (OUT) a checkpoint was saved in, or None when it lies elsewhere:
    OUT/checkpoints/step_NNNNNN beside OUT/config.toml."""
    parent = os.path.dirname(os.path.abspath(checkpoint_path))
    run = os.path.dirname(parent)
    if os.path.basename(parent) == "checkpoints" and os.path.isfile(
            os.path.join(run, RUN_CONFIG)):
        return run
    return None


def run_checkpoint(path: str, flag: str, hint: str = "") -> tuple[str, str, TrainConfig]:
    """The checkpoint a person names for ``flag`` (an export that needs to know the
    model), the run it lies in and that run's config; a ConfigError naming ``flag`` when
    it lies in no run (``hint``: what to do instead)."""
    found = resolve_checkpoint(path)
    run = run_of(found)
    if run is None:
        raise ConfigError(f"{flag}: {found} does not lie in a fullshard train run "
                          f"(OUT/checkpoints/step_N beside OUT/{RUN_CONFIG}, which says what "
                          f"model it holds){hint}")
    return found, run, load_toml(TrainConfig(), os.path.join(run, RUN_CONFIG))


def load(out: str, model: nn.Module, optimizer: list[torch.optim.Optimizer],
         device: torch.device, nf4_bases: bool = False) -> ResumePoint:
    """Load the latest checkpoint of the run in ``out`` into ``model`` and ``optimizer``;
    restore this rank's RNG state when the world size is the one it was saved at.
    ``nf4_bases``: the model's frozen bases are NF4, whose shards load only at the world
    size they were saved at (their quantization blocks are chosen per world size)."""
    if not has_checkpoint(out):
        raise ConfigError(f"--resume: no checkpoint in {checkpoint_dir(out)}; run without "
                          "--resume to start there")
    saved_world = (checkpoint.read_manifest(checkpoint_dir(out)) or {}).get("world_size")
    if nf4_bases and saved_world not in (None, dist.get_world_size()):
        raise ConfigError(
            f"--resume: the checkpoint in {checkpoint_dir(out)} holds NF4 base weights "
            f"(lora.base nf4) sharded over {saved_world} ranks, whose quantization blocks "
            f"depend on the world size; resume it on {saved_world} ranks (--nproc "
            f"{saved_world}), or train with lora.base fp32 to resume at any world size")
    extra = checkpoint.load(checkpoint_dir(out), model, optimizer)
    rng_states = extra["rng"]
    if len(rng_states) == dist.get_world_size():
        state = rng_states[dist.get_rank()]
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], device)
    return ResumePoint(extra["step"], extra["data"], extra["scaler"])


def clear(out: str) -> None:
    """Delete the checkpoints of an earlier run in ``out`` (rank 0, fresh starts)."""
    shutil.rmtree(checkpoint_dir(out), ignore_errors=True)


# -- restarts --------------------------------------------------------------------------

DIVERGED_FILE = "diverged"


def resumes_after_restart(out: str) -> bool:
    """Whether this worker restarts a job that has committed a checkpoint in ``out``."""
    return restart_count() > 0 and has_checkpoint(out) and saved_job(out) == job_id()


def record_divergence(out: str, message: str) -> None:
    """Rank 0: remember for this job's restarts that the run diverged, and how."""
    with open(os.path.join(out, DIVERGED_FILE), "w") as f:
        f.write(f"{job_id()}\n{message}\n")


def divergence_of_this_job(out: str) -> str | None:
    """The error a previous attempt of this job stopped on, on a restart; else None."""
    path = os.path.join(out, DIVERGED_FILE)
    if restart_count() == 0 or not os.path.isfile(path):
        return None
    with open(path) as f:
        job, message = f.read().split("\n", 1)
    return message.strip() if job == str(job_id()) else None


def forget_divergence(out: str) -> None:
    """Rank 0, on a job's first attempt: an earlier job's divergence does not concern it."""
    path = os.path.join(out, DIVERGED_FILE)
    if os.path.exists(path):
        os.remove(path)
