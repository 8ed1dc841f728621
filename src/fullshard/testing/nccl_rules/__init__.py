"""NCCL's rules, enforced on gloo: what NCCL turns into a hang, a crash or silent
corruption fails a CPU test instead.

NCCL matches collectives by their place in each communicator's sequence and checks
nothing a rank passes against its peers. gloo, which the CPU tests run on, often copes
where NCCL does not, so a CPU test passes where a GPU job would not. While enabled,
every collective on every process group is checked before it is issued:

* **Same collective, everywhere.** The ranks of the group compare the collective's
  signature (operation, dtypes, shapes, reduce op, root) and its number in the group's
  sequence, by an all-gather of two int64s on that group just before it. Different
  sizes, dtypes, reduce ops or operations at the same place (ranks that take different
  paths, or issue the same collectives in a different order) raise ``NcclRuleError``
  on every rank: "NCCL rule broken at collective #7 on group 'default_pg' (ranks
  [0, 1]): ... (rank 0 issued #7 all_reduce(float32[10], op=SUM); rank 1 issued #7
  all_reduce(float32[20], op=SUM))". Only groups on gloo with two or more ranks
  exchange.
* **No device tensors in objects.** ``all_gather_object``, ``broadcast_object_list``
  and the other object collectives refuse an object holding a tensor off the CPU: it
  would unpickle onto the sender's device on every receiver. On CPU a ``meta`` tensor
  stands for a device tensor.
* **Device tensors on the device group.** A group marked with
  ``stands_for_device(group, "cuda")``, and every NCCL group, refuses tensors on another
  device (NCCL takes no host tensors).

``fullshard.testing.run_distributed(..., nccl_rules=True)`` enables the checker on
every rank; left out, ``FULLSHARD_NCCL_RULES=1`` enables it on gloo, which
tests/conftest.py sets for the multi-rank files it lists (NCCL_RULES_FILES). Tests
whose ranks diverge on purpose stay out: the checker would refuse the divergence
before the error they check (fullshard's divergence guard, a collective's timeout).
The exchange costs one small gloo all-gather per collective: about +12% on
tests/test_api.py at 2 ranks (docs/architecture.md's Testing).

What no signature can tell apart: two collectives alike in every respect swapped on
one rank (two same-sized all-reduces of different tensors), and the split sizes of an
uneven all-to-all (only dtype and trailing dims are compared). Collectives issued from
C++ without passing ``ProcessGroup``'s Python methods (a functional collective's
backward, compiled graphs) are not checked, nor are point-to-point sends and receives.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Mapping

from . import checker
from .errors import NcclRuleError

ENV = "FULLSHARD_NCCL_RULES"

__all__ = ["NcclRuleError", "enable", "disable", "enabled", "checking",
           "stands_for_device", "wanted", "ENV"]


def enable() -> None:
    """Check every collective this process issues from now on (idempotent)."""
    checker.install()


def disable() -> None:
    """Stop checking; torch's collectives are as before."""
    checker.uninstall()


def enabled() -> bool:
    """Whether collectives are being checked."""
    return checker.active() is not None


@contextlib.contextmanager
def checking() -> Iterator[None]:
    """Check collectives within this context."""
    enable()
    try:
        yield
    finally:
        disable()


def stands_for_device(group, device_type: str = "cuda") -> None:
    """Treat ``group`` as a device group: its collectives refuse tensors that are not on
    ``device_type``. Call it after ``enable()``."""
    active = checker.active()
    if active is None:
        raise RuntimeError("fullshard.testing.nccl_rules: enable() before stands_for_device()")
    active.stands_for_device(group, device_type)


def wanted(requested: bool | None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether to check: ``requested`` when given, else whether ``FULLSHARD_NCCL_RULES``
    is "1"."""
    if requested is not None:
        return requested
    return environ.get(ENV, "0") == "1"
