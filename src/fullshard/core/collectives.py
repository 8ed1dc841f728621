"""Stateless collectives over a process group.

Each function takes tensors and a process group and returns a ``Pending``; none of
them reads module state. ``async_op=True`` returns before the data has arrived so
the caller can overlap the collective with compute and ``wait()`` later.

Note [collectives are always issued async]
Blocking calls are issued with async_op=True and waited at once: the cost is the
same and one code path serves both.

Note [reduce-scatter on gloo]
gloo's reduce_scatter is slow (measured at world size 2: 3.5 ms for 50K floats
where all_to_all plus a local sum takes 0.33 ms; 1.7-3.7x at world size 4 up to 4M
floats). On gloo we exchange the chunks with one all_to_all and sum the world_size
received copies of our chunk locally; other backends use their native reduce-scatter.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from .at_exit import note_collective

# torch >= 2.10 names the flat collectives *_single; older releases only have
# the *_into_tensor / *_tensor spellings (same semantics).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Whether a group of one rank skips its collectives (Note [shard groups of one rank] in
# core/group.py). Process-wide because the choice must be the same for every group and
# for the memory estimate's replay of them; only fullshard.testing's
# ``collectives_at_one_rank`` turns it off (the CUDA lane and the GPU benchmark on one GPU).
_ONE_RANK_SHORTCUTS = True


def skips_collectives(size: int) -> bool:
    """Whether a group of ``size`` ranks copies instead of communicating: one rank, unless
    the one-rank shortcuts were turned off (``fullshard.testing.collectives_at_one_rank``)."""
    return size == 1 and _ONE_RANK_SHORTCUTS


def set_one_rank_shortcuts(enabled: bool) -> bool:
    """Turn the one-rank shortcuts on or off, before the process shards anything (a group
    follows the setting in force whenever it acts); returns the previous setting. See
    ``fullshard.testing.collectives_at_one_rank``."""
    global _ONE_RANK_SHORTCUTS
    previous, _ONE_RANK_SHORTCUTS = _ONE_RANK_SHORTCUTS, bool(enabled)
    return previous


class CollectiveError(RuntimeError):
    """A fullshard collective failed or timed out; the message names the unit."""


# What a collective's failure says when the ranks, not this one, are the cause: a timeout,
# a peer gone, buffers of different sizes. Anything else (an error raised on this rank
# alone) is reported as it is, without guessing at diverged ranks.
_BETWEEN_RANKS = re.compile(r"timed? ?out|connection|peer|closed|reset|abort|broken pipe|"
                            r"mismatch|size", re.IGNORECASE)


def _failure(what: str, err: RuntimeError) -> CollectiveError:
    text = f"fullshard: {what} failed on rank {dist.get_rank()}: {err}"
    if isinstance(err, dist.DistError) or _BETWEEN_RANKS.search(str(err)):
        text += (". If it timed out or a peer went away, ranks probably took different paths "
                 "(a forward or backward on some ranks only, a layer skipped on one rank, a "
                 "rank that stopped early); run with FULLSHARD_DEBUG=1 to find where they "
                 "diverged.")
    return CollectiveError(text)


class Pending(NamedTuple):
    """A collective in flight; ``wait()`` returns its output once it has arrived."""

    output: torch.Tensor
    work: dist.Work | None
    finish: Callable[[], None] | None = None  # local work after the data arrived

    def wait(self, what: str = "a fullshard collective", patience=None) -> torch.Tensor:
        """Wait for the data; ``what`` ("all-gather of layers.3") names it in errors.

        ``patience`` (an object with ``stall_slice``, a timedelta, and ``stalled(what)``)
        makes a wait that blocks the host (gloo) wait in slices and call
        ``patience.stalled(what)`` after each, which may raise (Note [ranks agree on every
        collective] in core/divergence.py); the collective itself is never abandoned."""
        if self.work is not None and patience is not None:
            _wait_in_slices(self.work, what, patience)
        elif self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as err:
                raise _failure(what, err) from err
            note_collective()  # Note [collectives settle before exit]
        if self.finish is not None:
            self.finish()
        return self.output


def _wait_in_slices(work: dist.Work, what: str, patience) -> None:
    while True:
        try:
            work.wait(timeout=patience.stall_slice)
            return
        except RuntimeError as err:
            if _NO_FINITE_WAIT.search(str(err)):  # a Work that cannot wait in slices
                Pending(None, work).wait(what)
                return
            if work.is_completed():  # the collective itself failed (a peer, its timeout)
                raise _failure(what, err) from err
        patience.stalled(what)  # raises when the ranks diverged; else wait on


# Works that wrap a future (a process group behind a wrapper, e.g. torch's test harness's)
# refuse wait(timeout=): those are waited whole, as without a guard.
_NO_FINITE_WAIT = re.compile(r"finite timeout not implemented", re.IGNORECASE)


def _done(pending: Pending, async_op: bool, what: str, patience=None) -> Pending:
    note_collective()  # issued: Note [collectives settle before exit]
    return pending if async_op else Pending(pending.wait(what, patience), None)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
               async_op: bool = False, what: str = "an all-gather",
               patience=None) -> Pending:
    """Gather every rank's equal-sized ``shard`` into ``output`` (rank-major). ``what``
    and ``patience`` are as in ``Pending.wait`` (a blocking call waits with them)."""
    if skips_collectives(group.size()):
        output.copy_(shard)
        return Pending(output, None)
    work = _all_gather_flat(output, shard, group=group, async_op=True)
    return _done(Pending(output, work), async_op, what, patience)


def receives_into_scratch(backend: str, size: int) -> bool:
    """Whether ``reduce_scatter_sum`` over ``size`` ranks on ``backend`` uses a scratch
    buffer the size of ``full`` (gloo receives every rank's copy of this rank's chunk,
    Note [reduce-scatter on gloo])."""
    return not skips_collectives(size) and backend == "gloo"


def reduce_scatter_sum(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                       async_op: bool = False, scratch: torch.Tensor | None = None,
                       what: str = "a reduce-scatter", inspect=None) -> Pending:
    """Sum ``full`` (rank-major chunks) over ranks; this rank's chunk lands in ``output``.
    ``scratch`` (``full``-sized, see ``receives_into_scratch``) is used and may be reused after.
    ``inspect(rows)``, where the sum is taken on this rank (gloo), is called with every
    rank's copy of this rank's chunk (one row each) before they are summed."""
    if skips_collectives(group.size()):
        output.copy_(full)
        return Pending(output, None)
    if dist.get_backend(group) == "gloo":
        received = scratch if scratch is not None else torch.empty_like(full)
        return _done(_reduce_scatter_by_all_to_all(output, full, received, group, inspect),
                     async_op, what)
    work = _reduce_scatter_flat(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _done(Pending(output, work), async_op, what)


def _reduce_scatter_by_all_to_all(output: torch.Tensor, full: torch.Tensor,
                                  received: torch.Tensor, group: dist.ProcessGroup,
                                  inspect=None) -> Pending:
    """See Note [reduce-scatter on gloo]."""
    work = dist.all_to_all_single(received, full, group=group, async_op=True)

    def sum_copies() -> None:
        if inspect is not None:
            inspect(received.view(group.size(), -1))
        torch.sum(received.view(group.size(), -1), dim=0, out=output)

    return Pending(output, work, sum_copies)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup,
                   async_op: bool = False, what: str = "an all-reduce") -> Pending:
    """Sum ``tensor`` in place over ``group`` (the reduction across replicas)."""
    if skips_collectives(group.size()):
        return Pending(tensor, None)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _done(Pending(tensor, work), async_op, what)
