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


class BackendClock:
    """Seconds spent inside the process group's collectives while installed (a context
    manager); ``calls`` counts them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._saved: dict[str, object] = {}

    def __enter__(self) -> "BackendClock":
        cls = dist.ProcessGroup
        for name in _METHODS:
            # the class's own entry (a binding descriptor) goes back on exit; getattr's
            # plain function, which takes the group first, is what the wrapper calls
            if name in cls.__dict__:
                self._saved[name] = cls.__dict__[name]
                setattr(cls, name, self._timed(getattr(cls, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(dist.ProcessGroup, name, real)
        self._saved.clear()

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
