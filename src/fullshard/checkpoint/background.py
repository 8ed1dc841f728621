"""Saving in the background while training goes on.

Note [async save]
``save(..., async_save=True)`` copies this rank's shards (model, optimizer) into
fresh CPU tensors before it returns, so the training step after it may update the
parameters freely; a worker thread then writes, hashes and commits exactly as a
blocking save does (Note [atomic commit]) and the returned future completes when
the checkpoint is in place. The worker's collectives (DCP's planning, barriers,
gathering the file hashes) run on a gloo group of their own, so they never
interleave with the training step's collectives on the default group. The thread works
on the CUDA device of the rank that submitted the save (a thread starts on cuda:0). One
save is in flight at a time: the next save (either kind) first waits for the previous one.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

# One background save per process (Note [async save]): the worker thread, its own gloo
# group (created once: group creation is collective) and the save in flight, which the
# next save of any kind waits for.
_executor: ThreadPoolExecutor | None = None
_group: dist.ProcessGroup | None = None
_pending: Future | None = None


def wait_for_pending_save() -> None:
    """Block until the save in flight (if any) has committed; re-raise its error."""
    global _pending
    if _pending is not None:
        pending, _pending = _pending, None
        pending.result()


def checkpoint_group() -> dist.ProcessGroup | None:
    """The gloo group background saves communicate on (created on first use, on every
    rank, since every rank takes part in every save)."""
    global _group
    if _group is None and dist.is_available() and dist.is_initialized():
        _group = dist.new_group(backend="gloo")
    return _group


def staged_copy(state: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of every tensor in ``state`` (DTensors keep their sharding)."""
    def copy(v):
        if isinstance(v, DTensor):
            return DTensor(v._local_tensor.detach().to("cpu", copy=True), v._spec,
                           requires_grad=False)
        if isinstance(v, torch.Tensor):
            return v.detach().to("cpu", copy=True)
        return v
    return tree_map(copy, state)


def submit(job: Callable[[], str]) -> Future:
    """Run ``job`` on the checkpoint thread, on the caller's current CUDA device; the
    returned future yields its result."""
    global _executor, _pending
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fullshard-ckpt")
    device = _current_cuda_device()

    def on_callers_device() -> str:
        # The current device is per thread and a new one starts on cuda:0: without this,
        # DCP's stream synchronization in the thread would create a CUDA context on GPU 0
        # from every rank (memory taken from rank 0's GPU, one context per rank).
        if device is not None:
            torch.cuda.set_device(device)
        return job()
    _pending = _executor.submit(on_callers_device)
    return _pending


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device, if this process uses CUDA at all."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None
