"""Fault injection and probes for the trainer's tests: a worker dies at an exact point of
a run, or counts the collectives it issues.

    FULLSHARD_TEST_KILL_AT_STEP=K   rank 1 sends itself SIGKILL as step K starts
                                    (FULLSHARD_TEST_KILL_RANK=R: rank R instead);
                                    K1,K2,... with R1,R2,...: the i-th kill on the
                                    job's i-th attempt (a soak's kills, one per restart)
    FULLSHARD_TEST_KILL_IN_SAVE=K   rank 0 dies inside the save of step K's checkpoint,
                                    after every rank has written its shards and before
                                    the save commits (see fullshard.checkpoint.save)
    FULLSHARD_TEST_POISON_AT_STEP=K rank 1 fills its shard of the largest parameter with
                                    NaN as step K starts (the run diverges there)
    FULLSHARD_TEST_COUNT_COLLECTIVES=DIR
                                    each worker writes DIR/rank<R>.json at exit: its node
                                    (GROUP_RANK) and how many times it called each
                                    torch.distributed collective on each group of ranks
    FULLSHARD_TEST_PROBE_EXIT=DIR   each worker writes DIR/rank<R>.atexit from an atexit
                                    handler, and DIR/rank<R>.finalized if the interpreter
                                    finalizes (an object's __del__ as modules are cleared)
    FULLSHARD_TEST_STACKS_ON_SIGNAL=1
                                    every process (launchers too) prints the Python stack
                                    of each of its threads to stderr on SIGUSR1: what a
                                    test that waited too long shows of where a run hung

A test runs ``fullshard train`` with :func:`environment`: this directory on PYTHONPATH
and a variable set. Python imports ``sitecustomize`` when any process starts; in
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
KILL_RANK = "FULLSHARD_TEST_KILL_RANK"
POISON_AT_STEP = "FULLSHARD_TEST_POISON_AT_STEP"
COUNT_COLLECTIVES = "FULLSHARD_TEST_COUNT_COLLECTIVES"
STACKS_ON_SIGNAL = "FULLSHARD_TEST_STACKS_ON_SIGNAL"
PROBE_EXIT = "FULLSHARD_TEST_PROBE_EXIT"
# The collectives fullshard and the trainer call as torch.distributed.NAME.
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_to_all_single", "all_reduce", "broadcast",
               "all_gather", "all_gather_object", "broadcast_object_list", "barrier")
HERE = os.path.dirname(os.path.abspath(__file__))


def environment(variable: str, value) -> dict[str, str]:
    """Environment entries that arm fault or probe ``variable`` (at step ``value``, or
    writing to folder ``value``) in a ``fullshard train`` subprocess (to add to its
    environment)."""
    path = [HERE, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), variable: str(value)}


def _armed(variable: str, step: int) -> bool:
    """Whether the fault fires at ``step``: on the job's first attempt, or with a list of
    steps, the i-th on attempt i."""
    return _attempts_step(variable) == step


def _attempts_step(variable: str) -> int | None:
    from fullshard.train.launch.launcher import restart_count

    steps = [int(s) for s in os.environ.get(variable, "").split(",") if s]
    attempt = restart_count()
    return steps[attempt] if attempt < len(steps) else None


def _kill_rank() -> int:
    from fullshard.train.launch.launcher import restart_count

    ranks = [int(r) for r in os.environ.get(KILL_RANK, "1").split(",")]
    return ranks[min(restart_count(), len(ranks) - 1)]


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
    from fullshard.train.report.metrics import StepMemory

    begin_step = StepMemory.begin_step

    def wrapped(self, step: int) -> None:
        if dist.get_rank() == _kill_rank() and _armed(KILL_AT_STEP, step):
            _die()
        begin_step(self, step)

    StepMemory.begin_step = wrapped


def _poison_at_step() -> None:
    """Rank 1 writes NaN into its shard of the largest parameter as step K starts: that
    step's gradients, and so its global gradient norm, are not finite on every rank."""
    import torch
    import torch.distributed as dist
    from fullshard.train.loop import Trainer

    train_step = Trainer._train_step

    def wrapped(self):
        if dist.get_rank() == 1 and _armed(POISON_AT_STEP, self.step):
            largest = max(self.model.parameters(), key=lambda p: p.numel())
            with torch.no_grad():
                largest.to_local().fill_(float("nan"))
        return train_step(self)

    Trainer._train_step = wrapped


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


def _count_collectives(folder: str) -> None:
    """Wrap each collective of torch.distributed's namespace (before fullshard imports
    it) to count calls per (name, ranks of the group); write the counts at exit."""
    import atexit
    import json
    from collections import Counter

    import torch.distributed as dist

    counts: Counter = Counter()

    def counted(name, collective):
        def wrapped(*args, group=None, **kwargs):
            group_ = group or dist.group.WORLD
            ranks = ','.join(map(str, dist.get_process_group_ranks(group_)))
            # fullshard's own control traffic (core/guard/control.py's GROUP_DESC)
            guard = getattr(group_, "group_desc", "") == "fullshard_control"
            counts[f"{name} {ranks}{' guard' if guard else ''}"] += 1
            return collective(*args, group=group, **kwargs)
        return wrapped

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))

    def write() -> None:
        with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump({"node": int(os.environ.get("GROUP_RANK", "-1")), "counts": counts}, f)

    atexit.register(write)


class _SaysWhenFinalized:
    """Kept in this module's namespace until the interpreter clears it while finalizing;
    its ``__del__`` then writes a file (through a descriptor and ``os.write`` bound now:
    modules may be half gone by then)."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self._write, self._close = os.write, os.close
        self._write_on_delete = False

    def arm(self) -> None:
        self._write_on_delete = True

    def __del__(self):
        if self._write_on_delete:
            self._write(self._fd, b"finalized")
        self._close(self._fd)


_FINALIZED: _SaysWhenFinalized | None = None  # the probe's object (_probe_exit)


def _probe_exit(folder: str) -> None:
    """Note [a worker's process ends without the interpreter's finalization]: write what
    the worker's end went through."""
    import atexit

    global _FINALIZED
    rank = os.environ["RANK"]
    _FINALIZED = _SaysWhenFinalized(os.path.join(folder, f"rank{rank}.finalized"))

    def said_at_exit() -> None:
        with open(os.path.join(folder, f"rank{rank}.atexit"), "w") as f:
            f.write("atexit")
        _FINALIZED.arm()  # from here on, only finalization writes the other file

    atexit.register(said_at_exit)


def install() -> None:
    if STACKS_ON_SIGNAL in os.environ:
        import faulthandler
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if "LOCAL_RANK" not in os.environ:  # not a worker: the launcher, the test itself
        return
    if KILL_AT_STEP in os.environ:
        _kill_at_step_start()
    if KILL_IN_SAVE in os.environ:
        _kill_in_save()
    if POISON_AT_STEP in os.environ:
        _poison_at_step()
    if COUNT_COLLECTIVES in os.environ:
        _count_collectives(os.environ[COUNT_COLLECTIVES])
    if PROBE_EXIT in os.environ:
        _probe_exit(os.environ[PROBE_EXIT])


if __name__ == "sitecustomize":
    install()
