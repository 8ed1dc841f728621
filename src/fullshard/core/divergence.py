"""Divergence detection: ranks that take different paths fail loudly instead of hanging.

Note [collective fingerprints]
With ``FULLSHARD_DEBUG=1`` (or ``fully_shard(root, debug=True)``) every fullshard
collective is preceded by a fingerprint exchange on a separate gloo group: each rank
contributes (unit, operation, sequence number, forward/backward, grad mode) as five
integers and every rank compares them all. The first collective where ranks disagree
raises ``DivergenceError`` on every rank, naming what each rank was about to do; a
rank that does not reach the exchange within ``FULLSHARD_DEBUG_TIMEOUT`` seconds
(default 300) makes the others raise naming the collective they waited at. The
separate group keeps fingerprints from pairing with the user's own collectives. It
costs one small blocking all-gather per collective: a debugging mode, not a default.
"""

from __future__ import annotations

import datetime
import os
import zlib
from typing import Callable

import torch
import torch.distributed as dist

_OPS = ["all-gather", "all-gather (post-forward subgroup)", "reduce-scatter", "all-reduce"]
_FIELDS = 5


class DivergenceError(RuntimeError):
    """Ranks were about to run different collectives (or some never arrived)."""


def debug_enabled(requested: bool) -> bool:
    return requested or os.environ.get("FULLSHARD_DEBUG", "0") not in ("", "0")


def _code(name: str) -> int:
    return zlib.crc32(name.encode())


class DivergenceChecker:
    """Fingerprints every collective of one root's groups (see the note above)."""

    def __init__(self, unit_names: list[str], ranks: list[int], in_backward: Callable[[], bool]):
        self.in_backward = in_backward  # the root's phase, part of every fingerprint
        # only the mesh's ranks take part (the mesh may be a subset of the world)
        self.group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self.world = len(ranks)
        self.ranks = ranks
        self.names = {_code(name): name for name in unit_names}
        self.timeout_s = float(os.environ.get("FULLSHARD_DEBUG_TIMEOUT", "300"))
        self.sequence = 0

    def check(self, unit_name: str, op: str) -> None:
        self.sequence += 1
        mine = torch.tensor([_code(unit_name), _OPS.index(op), self.sequence,
                             int(self.in_backward()), int(torch.is_grad_enabled())],
                            dtype=torch.int64)
        rows = torch.empty(self.world * _FIELDS, dtype=torch.int64)
        work = dist.all_gather_into_tensor(rows, mine, group=self.group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            raise DivergenceError(
                f"fullshard debug: rank {dist.get_rank()} waited {self.timeout_s:.0f} s before "
                f"{self._describe(mine)} and not every rank arrived (a rank ran fewer "
                "fullshard collectives: a forward, backward or unshard on some ranks only, or "
                "it stopped early).") from err
        rows = rows.view(self.world, _FIELDS)
        if bool((rows == mine).all()):
            return
        lines = "\n".join(f"  rank {rank}: {self._describe(row)}"
                          for rank, row in zip(self.ranks, rows))
        raise DivergenceError(
            "fullshard debug: ranks diverged; at the same point of the run they were about "
            f"to run different collectives:\n{lines}\nEvery rank must run the same sharded "
            "modules in the same order with the same grad mode (no evaluation, skipped layer "
            "or unshard() on some ranks only).")

    def _describe(self, row: torch.Tensor) -> str:
        code, op, seq, backward, grad = (int(x) for x in row)
        unit = self.names.get(code, f"<unknown unit {code}>")
        phase = "backward" if backward else ("forward" if grad else "forward without grad")
        return f"{_OPS[op]} of '{unit}' (collective #{seq}, {phase})"
