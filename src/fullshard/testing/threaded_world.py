"""Ranks as threads of this process: torch's threaded process group.

torch's own FSDP2 tests (``FSDPTestMultiThread``) and some of its tools run every rank
as a thread of one process over the "threaded" backend
(``torch.testing._internal.distributed.multi_threaded_pg``): each thread has a
``torch.distributed`` world of its own, and collectives meet in memory. ``run_threaded``
runs a function that way, so fullshard can be checked on the process groups torch's
tests use, not only on gloo processes.
"""

from __future__ import annotations

import datetime
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)


def run_threaded(fn: Callable[[], Any], world_size: int, timeout: float = 60.0) -> dict[int, Any]:
    """Run ``fn()`` on ``world_size`` ranks, each a thread over torch's threaded process
    group; returns {rank: what fn returned}. A rank's exception is raised here with its
    traceback; ranks still running after ``timeout`` seconds raise TimeoutError."""
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    _install_threaded_pg()
    # each thread's collectives are its own rank's (torch's threaded tests set this too)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    try:
        threads = [threading.Thread(target=_rank, daemon=True,
                                    args=(fn, rank, world_size, store, timeout, results, failures))
                   for rank in range(world_size)]
        for thread in threads:
            thread.start()
        stuck = _join(threads, timeout)
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if failures:
        rank = min(failures)
        raise RuntimeError(f"rank {rank} of {world_size} (threaded) failed:\n{failures[rank]}")
    if stuck:
        raise TimeoutError(f"ranks {stuck} still running after {timeout:.0f} s (threaded)")
    return results


def _rank(fn, rank, world_size, store, timeout, results, failures) -> None:
    dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        results[rank] = fn()
    except SystemExit:  # torch's threaded group ended this rank's wait: another rank failed
        pass
    except BaseException as err:  # noqa: BLE001 - reported by run_threaded
        failures[rank] = traceback.format_exc()
        # wakes the other ranks out of collectives this one will never join
        ProcessLocalGroup.exception_handle(err)
    finally:
        dist.destroy_process_group()


def _join(threads: list[threading.Thread], timeout: float) -> list[int]:
    """Wait for every thread (``timeout`` in all); the ranks of those still running."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if stuck:  # ends the waits of collectives that will not complete
        ProcessLocalGroup.exception_handle(TimeoutError())
    return stuck
