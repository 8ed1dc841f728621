"""Collective functions check that every rank called them.

Note [every rank arrives]
A function that is collective (a checkpoint save or load, a full state dict) and is
called on some ranks only would wait in its first collective until the process group's
timeout (30 minutes by default) with nothing said: ``save`` under ``if rank == 0:`` is
the classic case. Such functions first check in: every rank contributes (which call, how
many check-ins before it) and waits at most as long as the process group would (its
timeout), or ``FULLSHARD_ARRIVAL_TIMEOUT`` seconds. A rank that waited that long raises
naming the call; ranks that arrive at different calls
raise on every rank, naming each rank's call. The raising process then ends, so a peer
waiting in another collective fails at once (its peer went away) instead of waiting out
its own timeout with nothing said. The wait is gloo's ``monitored_barrier``, which names the ranks
that did not arrive and leaves nothing pending behind it.

The check-in runs on the control channel of the whole job (core/guard/control.py, Note [one
control group]), made by the first ``fully_shard`` whose mesh spans the job: on a group of
its own it never pairs with a collective a late rank is waiting in, which on gloo aborts
the process ("collective mismatch") and on NCCL can hang or mix data. A comparison of the
divergence guard still in flight is finished first, so a save never follows a divergence
unnamed. Before that channel exists (checkpoints of plain modules) the default group serves
if it is gloo's; an NCCL job without the channel is not checked. A barrier and one gather
of two integers per call: cheap beside a save. How long it waits is the process group's
timeout, or ``FULLSHARD_ARRIVAL_TIMEOUT`` seconds (core/guard/control.py).
"""

from __future__ import annotations

import datetime
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import control
from ..comm import CollectiveError, all_gather

TIMEOUT_VARIABLE = control.TIMEOUT_VARIABLE
timeout_s = control.timeout_s

# How many check-ins this process made (the second field of each, so a rank one call
# ahead is caught too). Process-wide, because the calls it serves are collective over the
# whole job.
_arrivals = 0


def prepare(mesh: DeviceMesh) -> None:
    """Make the job's control channel, once, when ``mesh`` spans the job (every rank is
    here)."""
    world = dist.get_world_size()
    if world > 1 and mesh.size() == world:
        control.prepare(list(range(world)))


def every_rank_arrives(call: str) -> None:
    """Check that every rank is calling ``call`` now (Note [every rank arrives]); raise
    CollectiveError on a rank that waited too long, and on every rank when ranks called
    different functions."""
    global _arrivals
    world = dist.get_world_size()
    channel = control.channel_of(list(range(world)))
    group = channel.group if channel is not None else (
        dist.group.WORLD if dist.get_backend() == "gloo" else None)
    if world == 1 or group is None:  # NCCL alone has no bounded barrier to check in with
        return
    control.drain_all()  # the guard's comparison in flight first (Note [one control group])
    _arrivals += 1
    limit = timeout_s()
    try:
        # gloo's monitored barrier gives up after the timeout and leaves nothing pending,
        # so the process that raises can exit (a gather waited with a timeout cannot)
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=limit),
                               wait_all_ranks=True)
    except RuntimeError as err:
        raise CollectiveError(
            f"fullshard: {call} is collective, but not every rank called it within "
            f"{limit:g} s ({_first_line(err)}): call it on every rank, not under `if rank "
            f"== 0:`; {TIMEOUT_VARIABLE} sets how long to wait for ranks that arrive "
            "late.") from None
    mine = torch.tensor([zlib.crc32(call.encode()), _arrivals], dtype=torch.int64)
    everyone = torch.empty(world * 2, dtype=torch.int64)
    all_gather(everyone, mine, group, what=f"the check-in of {call}")
    rows = everyone.view(world, 2).tolist()
    if any(row != rows[0] for row in rows):  # every rank sees it, so all go on to name it
        calls: list = [None] * world
        dist.all_gather_object(calls, call, group=group)
        seen = ", ".join(f"rank {r}: {name} (check-in {count})"
                         for r, (name, (_, count)) in enumerate(zip(calls, rows)))
        raise CollectiveError(
            f"fullshard: ranks arrived at different collective functions ({seen}); every "
            "rank must make the same collective calls in the same order.")


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
