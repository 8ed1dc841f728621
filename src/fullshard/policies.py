"""Policies: frozen dataclasses with the field names of PyTorch FSDP2's.

A policy describes *what* to do; it never holds run-time state. Non-default
values that fullshard does not implement yet raise ``NotImplementedError`` at
``fully_shard`` time instead of being ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes used for compute and communication.

    Attributes:
        param_dtype: dtype the parameters are all-gathered and computed in
            (``None``: the sharded parameter's dtype).
        reduce_dtype: dtype gradients are reduce-scattered in (``None``:
            ``param_dtype``).
        output_dtype: dtype the module's floating-point outputs are cast to
            (``None``: no cast).
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @property
    def is_noop(self) -> bool:
        return self.param_dtype is None and self.reduce_dtype is None and self.output_dtype is None


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer states stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer states on the CPU.

    Attributes:
        pin_memory: pin the CPU shards so host-device copies can overlap compute.
    """

    pin_memory: bool = True
