"""Many ranks in one process: torch's fake process group, and the time its collectives take.

torch's "fake" backend sends nothing: one process stands for rank 0 of a job of any size,
so fullshard's per-rank behaviour (shard sizes, the collectives it issues, its host work
per step) can be measured at world sizes no machine here has. Its collectives still copy
the input into every rank's chunk of the output (torch 2.13's FakeProcessGroup), a cost
that grows with the world size and stands for what a real backend does on the wire:
``BackendClock`` measures it, so that fullshard's own host time can be told apart.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

# The process group's collective methods: every torch.distributed collective function
# ends in one of these, whatever name the caller imported it under.
_METHODS = ("all_gather_single", "_allgather_base", "allgather", "allgather_coalesced",
            "allgather_into_tensor_coalesced", "reduce_scatter_single", "_reduce_scatter_base",
            "reduce_scatter", "reduce_scatter_tensor_coalesced", "allreduce",
            "allreduce_coalesced", "all_to_all_single", "alltoall_base", "alltoall",
            "broadcast", "barrier", "gather", "scatter", "reduce")


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of ``world_size`` ranks over torch's fake backend."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _PatchedCollectives:
    """Replaces the process group's collective methods while installed (a context
    manager) with what ``_replacement(name, real)`` returns; puts them back on exit."""

    def __init__(self) -> None:
        self.calls = 0
        self._saved: dict[str, object] = {}

    def __enter__(self):
        cls = dist.ProcessGroup
        for name in _METHODS:
            # the class's own entry (a binding descriptor) goes back on exit; getattr's
            # plain function, which takes the group first, is what a wrapper calls
            if name in cls.__dict__:
                self._saved[name] = cls.__dict__[name]
                setattr(cls, name, self._replacement(name, getattr(cls, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(dist.ProcessGroup, name, real)
        self._saved.clear()

    def _replacement(self, name: str, real):
        raise NotImplementedError


class BackendClock(_PatchedCollectives):
    """Seconds spent inside the process group's collectives while installed (a context
    manager); ``calls`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def _replacement(self, name: str, real):
        return self._timed(real)

    def _timed(self, real):
        clock = self

        def method(pg, *args, **kwargs):
            started = time.thread_time()
            try:
                return real(pg, *args, **kwargs)
            finally:
                clock.seconds += time.thread_time() - started
                clock.calls += 1
        return method


# The methods whose first argument is where the data lands (filled with zeros by
# ``QuietBackend``); the others (all-reduce, broadcast, barrier) leave their tensors as
# they are.
_WRITES_FIRST = ("all_gather_single", "_allgather_base", "allgather", "allgather_coalesced",
                 "allgather_into_tensor_coalesced", "reduce_scatter_single",
                 "_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced",
                 "all_to_all_single", "alltoall_base", "alltoall", "gather", "scatter")


class QuietBackend(_PatchedCollectives):
    """While installed (a context manager), the process group's collectives move no data
    and finish at once: what they write is zeroed (a cost that does not grow with the
    world size). What a step then spends is the caller's own host work alone, without the
    fake backend's copies into every rank's chunk (which leave the caches colder for
    what follows, in proportion to the world size: not the caller's cost)."""

    def _replacement(self, name: str, real):
        return self._quiet(name in _WRITES_FIRST)

    def _quiet(self, writes_first: bool):
        backend = self

        def method(pg, *args, **kwargs):
            backend.calls += 1
            if writes_first and args:
                for t in _tensors(args[0]):
                    t.zero_()
            done = torch.futures.Future()
            done.set_result(None)
            return torch._C._distributed_c10d._create_work_from_future(done)
        return method


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
