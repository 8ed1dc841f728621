"""Run a function on N local ranks (gloo on CPU, or NCCL with one GPU per rank) and
collect what each returns.

gloo ranks come from a forkserver that has already imported torch, so a 4-rank
test starts in well under a second. NCCL ranks are spawned: a child forked after the
CUDA driver was initialized cannot use CUDA, nothing promises that the forkserver's
imports never ask CUDA anything, and a spawned interpreter starts clean. Ranks meet
through a ``file://`` rendezvous in a fresh temporary directory: no ports, no races
between concurrent tests. When one rank fails the others are given a few seconds and
then killed, so a bug shows up as the failing rank's traceback, not as a hang.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from .devices import check_gpus_for_ranks, uses_cuda
from .nccl_rules import wanted

_CTX = None  # the forkserver context, started once per test process (it preloads torch)
GRACE_AFTER_FAILURE_S = 5.0
RELEASE_WAIT_S = 1.0  # the most a rank that has reported waits for its peers to report


def _context(backend: str):
    global _CTX
    if uses_cuda(backend):
        return mp.get_context("spawn")
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(
            ["torch", "torch._dynamo", "torch.distributed.tensor", "fullshard"])
    return _CTX


def _worker(fn: Callable, rank: int, world_size: int, init_file: str, backend: str,
            nccl_rules: bool, results: Any, args: tuple, kwargs: dict) -> None:
    # What the forkserver preloaded (torch and its modules: some 300,000 objects) is never
    # garbage: frozen, the collection before the group is destroyed scans only what this
    # rank made (150 ms less per rank on 2 cores) and touches no inherited page.
    gc.freeze()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    # A rank killed by a signal (a segfault in a kernel or a collective) cannot report
    # through the queue: faulthandler leaves every thread's Python stack in a file the
    # parent attaches to the failure.
    fault_log = open(_fault_log(init_file, rank), "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.enable(file=fault_log, all_threads=True)
    # What the C++ runtime prints before it aborts ("terminate called after throwing an
    # instance of 'gloo::EnforceNotMet'", glibc's heap checks) goes to file descriptor 2
    # from a thread Python never sees; kept in a file, its tail is attached to the failure
    # of a rank that died, and the whole of it is written to the caller's stderr after.
    rank_stderr = os.open(_stderr_log(init_file, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(rank_stderr, 2)
    os.close(rank_stderr)

    torch.set_num_threads(1)
    try:
        options = {}
        if uses_cuda(backend):  # rank r on GPU r (NCCL refuses two ranks on one GPU)
            options["device_id"] = torch.device("cuda", rank)
            torch.cuda.set_device(options["device_id"])
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, **options)
        if nccl_rules:
            from . import nccl_rules as rules

            rules.enable()
        torch.manual_seed(0)
        # Pickled here, by value: the queue's own pickler would share tensors through
        # file descriptors that die with this process before the parent reads them.
        value = pickle.dumps(fn(*args, **kwargs))
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        # Torn down once every rank has reported, or a second later: a rank that returned
        # right after creating a group (``new_group``) would otherwise close its sockets
        # while a slower peer is still connecting to them, and fail it. Not longer: a rank
        # that stops early must still go away, as a real process does, for its peers'
        # collectives to fail (the tests of what they report then).
        _wait_for_release(init_file, RELEASE_WAIT_S)
        gc.collect()  # drop objects holding the group first (see examples/quickstart.py)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
                    backend: str = "gloo", nccl_rules: bool | None = None,
                    **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be importable (defined at module level). The process group is
    initialized before ``fn`` runs and ``torch.manual_seed(0)`` is set on every rank.
    With ``backend="nccl"`` rank ``r`` runs on ``cuda:r`` (its current device), and
    ``world_size`` must not exceed the GPUs visible; ``fn`` should return CPU values.
    ``nccl_rules`` checks every collective against NCCL's rules
    (``fullshard.testing.nccl_rules``); left out, it is on for gloo when
    ``FULLSHARD_NCCL_RULES=1``, and off for NCCL.
    Raises ``AssertionError`` with every failing rank's traceback, or
    ``TimeoutError`` naming the ranks that did not finish.
    """
    if uses_cuda(backend):
        check_gpus_for_ranks(world_size)
    ctx = _context(backend)
    results = ctx.Queue()
    checks = bool(nccl_rules) if uses_cuda(backend) else wanted(nccl_rules)
    with tempfile.TemporaryDirectory(prefix="fullshard-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, init_file, backend,
                                                   checks, results, args, kwargs), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outcomes = _collect(results, procs, world_size, timeout)
        open(_release_file(init_file), "w").close()  # noqa: SIM115 - its existence is the signal
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        for r, (ok, tb) in list(outcomes.items()):
            if not ok and tb.startswith(_EXITED):
                outcomes[r] = (False, tb + _read_stderr_tail(init_file, r)
                               + _read_fault_log(init_file, r))
        _replay_stderr(init_file, world_size)
    failures = {r: tb for r, (ok, tb) in outcomes.items() if not ok}
    if failures:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed:\n{report}")
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s "
                           "(a hang: ranks issued different collectives?)")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


_EXITED = "process exited with code"


def _release_file(init_file: str) -> str:
    return f"{init_file}.released"


def _wait_for_release(init_file: str, timeout: float) -> None:
    """Wait until the parent has every rank's outcome (it creates the release file then),
    at most ``timeout`` seconds.
    A file, polled, rather than a multiprocessing.Event: setting an Event waits for each
    rank asleep on it to wake, forever if one of them died asleep (a rank killed by a
    peer's abort)."""
    deadline = time.monotonic() + timeout
    path = _release_file(init_file)
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.002)


def _fault_log(init_file: str, rank: int) -> str:
    return f"{init_file}.rank{rank}.fault"


def _stderr_log(init_file: str, rank: int) -> str:
    return f"{init_file}.rank{rank}.stderr"


STDERR_TAIL_LINES = 30


def _read_stderr(init_file: str, rank: int) -> str:
    try:
        with open(_stderr_log(init_file, rank), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _replay_stderr(init_file: str, world_size: int) -> None:
    """Each rank's stderr, its lines marked with the rank, on the caller's stderr."""
    for r in range(world_size):
        text = _read_stderr(init_file, r)
        if text:
            sys.stderr.write("".join(f"[rank {r}] {line}\n" for line in text.splitlines()))
    sys.stderr.flush()


def _read_stderr_tail(init_file: str, rank: int) -> str:
    lines = _read_stderr(init_file, rank).strip().splitlines()
    tail = "\n".join(lines[-STDERR_TAIL_LINES:])
    return f"\nits last {STDERR_TAIL_LINES} lines of stderr at most:\n{tail}" if tail else ""


def _read_fault_log(init_file: str, rank: int) -> str:
    try:
        with open(_fault_log(init_file, rank)) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"\nwhere it died (faulthandler):\n{text}" if text else ""


def _collect(results: Any, procs: list, world_size: int, timeout: float) -> dict:
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size:
        failed = any(not ok for ok, _ in outcomes.values())
        remaining = deadline - time.monotonic()
        if failed:
            remaining = min(remaining, GRACE_AFTER_FAILURE_S)
        if remaining <= 0:
            break
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
            outcomes[rank] = (ok, value)
            if failed or not ok:
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in outcomes
                    and p.exitcode not in (0, None)]
            for i in dead:
                outcomes[i] = (False, f"{_EXITED} {procs[i].exitcode}")
    for p in procs:
        if p.is_alive() and len(outcomes) < world_size:
            p.kill()
    return outcomes
