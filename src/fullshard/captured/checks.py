"""What a CUDA graph cannot hold, refused in one line before anything is captured."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..core.guard.divergence import debug_enabled
from ..core.state import UnitState, units_in
from .errors import CaptureError

MIN_WARMUP = 2  # the last two eager steps are compared (steady.py)


def compute_device(model: nn.Module, units: list[UnitState]) -> torch.device:
    for unit in units:
        if unit.group is not None:
            return unit.group.compute_device
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _host_work(units: list[UnitState]) -> None:
    for unit in units:
        if unit.group is not None and unit.group.offload is not None:
            _refuse_host(unit, "offload's copies and optimizer step",
                         f"offload_policy={type(unit.group.offload).__name__}",
                         "capture a model without offload")
    for unit in units:
        if debug_enabled(unit.debug):
            _refuse_host(unit, "the guard's comparison before every collective",
                         "debug=True or FULLSHARD_DEBUG=1", "turn debug mode off")


def _refuse_host(unit: UnitState, what: str, because: str, fix: str) -> None:
    raise CaptureError(
        f"fullshard.capture_step: unit '{unit.name}' runs {what} on the host ({because}), "
        f"which a CUDA graph cannot replay: {fix}")


def _optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    for optimizer in optimizers:
        for index, group in enumerate(optimizer.param_groups):
            if "capturable" in group and not group["capturable"]:
                raise CaptureError(
                    f"fullshard.capture_step: {type(optimizer).__name__}'s param group "
                    f"{index} has capturable=False: its step count lives on the host and "
                    "a CUDA graph would replay the first one; build the optimizer with "
                    "capturable=True")


def refuse_uncapturable(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                        warmup: int) -> torch.device:
    """Refuse what a graph of ``model``'s step cannot hold; the device it computes on.
    The device comes last, so that a program tried on CPU first hears of everything
    else it would have to change."""
    if warmup < MIN_WARMUP:
        raise CaptureError(
            f"fullshard.capture_step: warmup={warmup}: at least {MIN_WARMUP} eager steps "
            "run before capture, so that the last two can be compared; torch's examples "
            "warm up 3")
    units = units_in(model)
    _host_work(units)
    _optimizers(optimizers)
    return compute_device(model, units)


def refuse_device(model: nn.Module, device: torch.device) -> None:
    if device.type != "cuda":
        raise CaptureError(
            f"fullshard.capture_step: {type(model).__name__} computes on {device}: a CUDA "
            "graph captures CUDA work only; run the step eagerly there")
