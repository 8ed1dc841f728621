"""Objects sent through object collectives carry no device tensors.

``all_gather_object`` and its kin pickle on the sender and unpickle on every receiver;
a CUDA tensor inside unpickles onto the sender's device index on another process (a
foreign GPU, or "Attempting to deserialize object on CUDA device k" where each process
sees one GPU). On CPU every real tensor is on the host, so a test puts a tensor on the
``meta`` device to stand for a device tensor: any tensor off the CPU is refused.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from typing import Any, Iterator

import torch

from .errors import NcclRuleError

_context = threading.local()  # which object collective, on which group, is pickling


class HostOnlyPickler(pickle.Pickler):
    """A pickler that refuses tensors off the CPU, naming the object collective."""

    def reducer_override(self, obj: Any) -> Any:
        """Refuse a non-CPU tensor; leave everything else to the usual reduction."""
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            raise NcclRuleError(device_tensor_message(obj))
        return NotImplemented


def device_tensor_message(tensor: torch.Tensor) -> str:
    """The refusal: which rank, which object collective and group, which tensor."""
    op, where, rank = getattr(_context, "current", None) or ("an object collective", "a group", "?")
    return (f"NCCL rule broken on rank {rank}: {op} on {where} pickles a "
            f"{tensor.device.type} tensor {str(tensor.dtype).removeprefix('torch.')}"
            f"{list(tensor.shape)}; it would unpickle onto the sender's device on every "
            f"receiver: move it to the CPU first (.cpu()) or send it as a tensor")


@contextlib.contextmanager
def pickling_for(op: str, where: str, rank: int) -> Iterator[None]:
    """Within this context, a refusal names ``op`` on ``where`` at ``rank``."""
    saved = getattr(_context, "current", None)
    _context.current = (op, where, rank)
    try:
        yield
    finally:
        _context.current = saved
