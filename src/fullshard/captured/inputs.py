"""The tensors a captured step reads: fixed at capture, refilled before each replay."""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import CaptureError, describe


def _refused(index: int, have, want: str) -> CaptureError:
    return CaptureError(
        f"fullshard.capture_step: input {index} is {have} where the step needs {want}: a "
        "CUDA graph reads its inputs at fixed addresses with fixed shapes and dtypes; pad "
        "or cast it to the captured input, or capture one step per shape")


class StaticInputs:
    """The step's inputs as captured. A graph reads them at the addresses it was captured
    with, so fresh inputs are copied into these tensors, never swapped in."""

    def __init__(self, tensors: Sequence, device: torch.device):
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device != device:
                raise _refused(i, describe(t), f"a tensor on {device}")
        self.tensors = tuple(tensors)

    def copy_in(self, fresh: Sequence) -> None:
        """Copy ``fresh`` into the static tensors, after checking each is what the graph
        was captured with (a smaller batch would read stale rows, a larger one would be
        cut, silently)."""
        for i in range(max(len(fresh), len(self.tensors))):
            have = fresh[i] if i < len(fresh) else None
            want = self.tensors[i] if i < len(self.tensors) else None
            if not _same_kind(have, want):
                raise _refused(i, describe(have), f"{describe(want)} (the captured input)"
                               if want is not None else
                               f"nothing (it was captured with {len(self.tensors)} inputs)")
        for static, t in zip(self.tensors, fresh):
            if t is not static:
                static.copy_(t, non_blocking=True)


def _same_kind(have, want) -> bool:
    return (isinstance(have, torch.Tensor) and isinstance(want, torch.Tensor)
            and have.shape == want.shape and have.dtype == want.dtype
            and have.device == want.device)
