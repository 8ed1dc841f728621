"""Restarts under ``--max-restarts``: which attempt a worker is, and where it continues.

Note [restarts]
When a worker fails, torchrun stops every worker of the job and, up to ``--max-restarts``
times, starts them all again with the same command line and TORCHELASTIC_RESTART_COUNT
raised by one. A restarted worker resumes from the latest checkpoint in --out when this
job wrote it (checkpoints record TORCHELASTIC_RUN_ID), exactly as --resume would, so the
run ends with the weights of an uninterrupted one; a job that failed before its first
checkpoint starts again from scratch. torchrun gives each job a fresh id with
--standalone (what ``fullshard train`` uses on one node); multi-node jobs with the
default static rendezvous all share the id "none", so there a restart also takes a
checkpoint an earlier job left in --out if the first attempt died before clearing it.

A run stopped on a non-finite loss would diverge again from the same checkpoint, every
restart: rank 0 leaves OUT/diverged naming the job and the error, and restarted workers
of that job repeat the error and exit instead of training.
"""

from __future__ import annotations

import os

from . import checkpoints
from .launch import job_id, restart_count

DIVERGED_FILE = "diverged"


def resumes_after_restart(out: str) -> bool:
    """Whether this worker restarts a job that has committed a checkpoint in ``out``."""
    return (restart_count() > 0 and checkpoints.has_checkpoint(out)
            and checkpoints.saved_job(out) == job_id())


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
