"""Every tensor operation a step dispatches, collectives included, as torch sees them.

Collectives are recorded below every import site: torch.distributed's functions, the
process group's methods and the functional collectives all dispatch a ``c10d`` (or
``_c10d_functional``) operator, which a TorchDispatchMode sees whoever called it. The same
log gives each operation's output sizes, so a step's allocations can be compared across
world sizes. Tests and benchmarks only: a dispatch mode slows every operation down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


@dataclass(frozen=True)
class Op:
    """One dispatched operation: its name (``c10d._allgather_base_``), the numel of each
    tensor it took (``inputs``) and returned (``outputs``), in argument order, and whether
    its outputs are new memory (``allocates``: neither a view nor written in place)."""

    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    allocates: bool

    @property
    def is_collective(self) -> bool:
        return self.name.split(".")[0] in COLLECTIVE_NAMESPACES

    @property
    def kind(self) -> str:
        """``all_gather``, ``reduce_scatter``, ``all_reduce`` or the operator's own name:
        c10d and the functional collectives spell them differently."""
        plain = self.name.split(".")[-1].replace("_", "")
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            if kind.replace("_", "") in plain:
                return kind
        return self.name


class DispatchLog(TorchDispatchMode):
    """Records each operation dispatched while active, in order, in ``ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(Op(_name(func), _numels((args, kwargs)), _numels(out),
                           not func.is_view and not func._schema.is_mutable
                           and func.namespace not in COLLECTIVE_NAMESPACES))
        return out

    @property
    def collectives(self) -> list[Op]:
        """The collectives, in the order this rank issued them."""
        return [op for op in self.ops if op.is_collective and not op.name.endswith("wait_tensor")]


def _name(func) -> str:
    # "c10d._allgather_base_" from "c10d._allgather_base_.default"
    return ".".join(str(func).split(".")[:2])


def _numels(tree) -> tuple[int, ...]:
    return tuple(t.numel() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))
