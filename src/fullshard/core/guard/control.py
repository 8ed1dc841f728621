"""The control channel: fullshard's own host-side traffic between ranks, one gloo group.

Note [one control group]
Two things compare ranks on the host rather than through the data's collectives: the
divergence guard (core/guard/divergence.py), whose comparisons must not pair with a collective
a diverged rank is waiting in, and the check-in of collective functions (core/guard/arrival.py),
which must not pair with a collective a late rank is waiting in. Both run on one gloo
group per set of ranks, made by ``fully_shard`` (every rank calls it, so the group can be
made there; made later, by a call only some ranks reach, it would hang): one group rather
than one per feature, because at 1,024 ranks each gloo group can hold a socket per peer;
and it connects to a peer only when it first talks to it (``_connecting_on_first_use``),
so a rank holds sockets to its ring neighbours, not to every rank.
Operations on it pair by the order they were issued in, and at most one of them is in
flight (``Channel.drain`` finishes it): every rank issues the same sequence on it as long
as the ranks agree, which is what it checks.

How long it waits is the process group's own timeout (NCCL's 10 minutes, gloo's 30 by
default, or what ``init_process_group(timeout=...)`` set), so a rank that is merely slow
(a save or an evaluation on rank 0, a cold compile cache) is waited for as long as the
collectives of the data would wait for it; ``FULLSHARD_ARRIVAL_TIMEOUT`` overrides it.

Under torch's "fake" process group (one process stands for every rank: the scale lane)
and its "threaded" one (ranks as threads of one process, which would share the
process-wide channels) there is no channel: nothing to compare.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ..comm import communicates_on

TIMEOUT_VARIABLE = "FULLSHARD_ARRIVAL_TIMEOUT"
GROUP_DESC = "fullshard_control"  # what tools that count collectives tell it apart by


def communicates() -> bool:
    """Whether ranks are processes of their own that talk over a real backend."""
    return str(dist.get_backend()) not in ("fake", "threaded")


def process_group_timeout(group: dist.ProcessGroup | None = None) -> float:
    """Seconds ``group`` (default: the default group) waits in a collective."""
    group = group if group is not None else dist.group.WORLD
    for device in ("cuda", "cpu"):
        try:
            backend = group._get_backend(torch.device(device))
            return backend.options._timeout.total_seconds()
        except (RuntimeError, AttributeError):  # no backend for that device, or no options
            continue
    backend = dist.get_backend(group)
    return dist.distributed_c10d._get_default_timeout(backend).total_seconds()


def timeout_s() -> float:
    """How long fullshard's comparisons and check-ins wait for every rank: the default
    process group's timeout, or ``FULLSHARD_ARRIVAL_TIMEOUT`` seconds where it is set."""
    text = os.environ.get(TIMEOUT_VARIABLE, "")
    if not text:
        return (process_group_timeout() if dist.is_initialized()
                else default_pg_timeout.total_seconds())
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{TIMEOUT_VARIABLE}={text!r}: expected a positive number of seconds")
    return value


_LAZY_VARIABLE = "TORCH_GLOO_LAZY_INIT"


@contextlib.contextmanager
def _connecting_on_first_use():
    """Make the gloo group built inside connect to a peer when it first talks to it.
    A gloo group connects to every peer when made: at 1,024 ranks, a socket to each of
    1,023 peers in every process, for traffic that mostly runs in a ring (an all-reduce
    talks to two neighbours). gloo reads this switch when a group is built, so setting it
    for the one call changes no other group of the process (and none where it is set
    already)."""
    if _LAZY_VARIABLE in os.environ:
        yield
        return
    os.environ[_LAZY_VARIABLE] = "1"
    try:
        yield
    finally:
        del os.environ[_LAZY_VARIABLE]


class Channel:
    """One set of ranks' control group and the one operation in flight on it."""

    def __init__(self, ranks: tuple[int, ...]):
        self.ranks = ranks
        self.limit_s = timeout_s()
        with _connecting_on_first_use():
            self.group = dist.new_group(
                list(ranks), backend="gloo", use_local_synchronization=True,
                timeout=datetime.timedelta(seconds=self.limit_s), group_desc=GROUP_DESC)
        communicates_on(self.group)  # Note [groups left with a collective that cannot finish]
        self._in_flight: Callable[[], None] | None = None

    def hold(self, finish: Callable[[], None]) -> None:
        """Keep ``finish`` (of an operation just issued) until ``drain`` calls it."""
        self.drain()
        self._in_flight = finish
        _drain_at_exit()

    def drain(self) -> None:
        """Finish the operation in flight, if any (it may raise)."""
        finish, self._in_flight = self._in_flight, None
        if finish is not None:
            finish()


# One channel per set of ranks, made by the first fully_shard over them. Process-wide:
# the group is shared by every model over those ranks and by the check-ins.
_CHANNELS: dict[tuple[int, ...], Channel] = {}


def prepare(ranks: list[int]) -> Channel | None:
    """The channel of ``ranks``, made now if it is not yet (collectively: ``fully_shard``
    time, on every rank of ``ranks``); None where ranks do not communicate."""
    key = tuple(ranks)
    if len(key) < 2 or not communicates():
        return None
    if key not in _CHANNELS:
        _CHANNELS[key] = Channel(key)
    return _CHANNELS[key]


def channel_of(ranks: list[int]) -> Channel | None:
    """The channel made for ``ranks``, if any."""
    return _CHANNELS.get(tuple(ranks))


_EXIT_REGISTERED = False


def _drain_at_exit() -> None:
    """Finish what is still in flight when the interpreter exits: the comparison of a
    program's last step would otherwise never be finished, and a divergence there never
    named. Registered once, by the first operation held."""
    global _EXIT_REGISTERED
    if not _EXIT_REGISTERED:
        _EXIT_REGISTERED = True
        atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    if not dist.is_initialized():  # destroy_process_group() ran: nothing left to finish
        return
    try:
        drain_all()
    except Exception as err:  # noqa: BLE001 - said, not raised: the interpreter is ending
        print(f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)


def drain_all() -> None:
    """Finish what is in flight on every channel (before a check-in, or a save: a
    comparison still pending is settled first, so no checkpoint follows a divergence)."""
    for channel in list(_CHANNELS.values()):
        channel.drain()
