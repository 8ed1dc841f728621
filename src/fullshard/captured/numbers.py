"""The Python numbers of the optimizers' parameter groups, as a graph captured them."""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import CaptureError


def _is_number(value) -> bool:
    if isinstance(value, tuple):
        return all(map(_is_number, value))  # betas
    return isinstance(value, (bool, int, float))


def _numbers(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params" and _is_number(v)}
            for group in optimizer.param_groups]


class GroupNumbers:
    """A CUDA graph holds each Python number its kernels were launched with (a learning
    rate, a weight decay): a scheduler that sets ``group["lr"] = 0.5`` afterwards changes
    nothing the replay does. This remembers them at capture and refuses a replay after
    one changed; a tensor ``lr`` updated in place is read by the graph and not checked."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        self.captured = [_numbers(o) for o in self.optimizers]

    def check_unchanged(self) -> None:
        for optimizer, before in zip(self.optimizers, self.captured):
            for index, (was, group) in enumerate(zip(before, optimizer.param_groups)):
                for key, value in was.items():
                    now = group.get(key)
                    if not _is_number(now) or now != value:
                        raise CaptureError(
                            f"fullshard.capture_step: {type(optimizer).__name__}'s param "
                            f"group {index} has {key}={now!r}, captured with "
                            f"{key}={value!r}: the CUDA graph replays the captured value; "
                            f"give the optimizer a tensor {key} and update it in place, or "
                            "capture again")
