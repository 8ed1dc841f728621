"""The one error ``capture_step`` raises for what a CUDA graph cannot hold."""

from __future__ import annotations


class CaptureError(RuntimeError):
    """A step, model, optimizer or input that a CUDA graph cannot capture or replay as
    given; the message is one line naming it and what to do (docs/errors.md E373-E379)."""


def describe(value) -> str:
    """``value`` as the messages name an input: its dtype, shape and device."""
    import torch
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        article = "an" if dtype.startswith("int") else "a"
        return f"{article} {dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    return "nothing" if value is None else f"a {type(value).__name__}"
