"""Policies: frozen dataclasses with the field names of PyTorch FSDP2's.

A policy describes *what* to do; it never holds run-time state. Non-default
values that fullshard does not implement yet raise ``NotImplementedError`` at
``fully_shard`` time instead of being ignored.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import torch

from .torch_version import REDUCE_IN_GRAD_DTYPE


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes used for compute and communication.

    Attributes:
        param_dtype: dtype the parameters are all-gathered and computed in
            (``None``: the sharded parameter's dtype).
        reduce_dtype: dtype gradients are reduce-scattered in, and accumulated in
            without gradient sync. ``None``: with torch 2.15 and later the parameters'
            own dtype, before it ``param_dtype`` (as the installed torch's FSDP2 does:
            Note [torch versions]).
        output_dtype: dtype the module's floating-point outputs are cast to
            (``None``: no cast).
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype``.
        param_dtype_override_fn: called once per parameter at ``fully_shard``; returning
            the parameter's own dtype keeps that parameter in it (gathered and computed
            unconverted), ``None`` or ``param_dtype`` uses ``param_dtype`` (torch 2.15's
            field, on every torch).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[torch.nn.Parameter], torch.dtype | None] | None = \
        field(default=None, kw_only=True)

    def reduce_dtype_for(self, param_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype parameters of ``param_dtype`` reduce their gradients in (None: the
        gradients' own dtype, ``param_dtype`` or the compute dtype)."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return param_dtype if REDUCE_IN_GRAD_DTYPE else self.param_dtype

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
        params_on_device: also keep a copy of the sharded parameters on the compute device,
            in the dtype they are gathered in, so that gathers read it instead of copying
            the shard from the host each time: one host-to-device copy per optimizer step
            rather than one per gather (forward, backward, each micro-batch), for the
            shard's size in device memory. Gradients and optimizer states stay on the host
            and the optimizer steps the host's parameters, as DeepSpeed's
            ``offload_optimizer`` without ``offload_param`` (Note [parameters kept on the
            device] in core/storage.py). The copy is refreshed when the shard was written
            in place: by an optimizer step, a load, or an op on the parameter itself; a
            write through ``param.data`` is not seen.
    """

    pin_memory: bool = True
    params_on_device: bool = field(default=False, kw_only=True)


@dataclass(frozen=True)
class DiskOffloadPolicy(CPUOffloadPolicy):
    """CPU offload whose optimizer states live in files under ``path`` (NVMe offload).

    Parameters and gradients are sharded on the CPU as with ``CPUOffloadPolicy``; the
    optimizer's per-element states (Adam's ``exp_avg``/``exp_avg_sq``, momentum buffers)
    of the unit's parameters are kept on disk and streamed through the host in chunks
    during ``optimizer.step()`` (Note [optimizer states on disk]).

    Attributes:
        path: a writable directory on a local disk; fullshard creates a folder of its own
            in it and removes it when the optimizer is gone or the process exits.
        chunk_numel: parameter elements stepped at a time. Host memory for the states is
            three chunks' worth (reading ahead, stepping, writing back):
            ``3 * chunk_numel * bytes of states per element`` (24 bytes x chunk_numel for
            fp32 Adam). Rounded up to a multiple of 4096.
        params: also keep the unit's sharded parameters in a file under ``path``, paged
            in when used (each gather's copy-in, the optimizer step, state dicts) and
            given back right after (Note [parameters on disk] in core/features/mapped.py).
    """

    path: str = field(kw_only=True)
    chunk_numel: int = field(default=1 << 22, kw_only=True)
    params: bool = field(default=False, kw_only=True)


def _torch_policies() -> tuple[type, type, type]:
    """torch's own policy classes (fullshard accepts them wherever it accepts its own)."""
    from torch.distributed import fsdp

    return fsdp.MixedPrecisionPolicy, fsdp.OffloadPolicy, fsdp.CPUOffloadPolicy


def as_mp_policy(value, label: str) -> MixedPrecisionPolicy:
    """``value`` as fullshard's MixedPrecisionPolicy: ours, or torch's with the same fields."""
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, _torch_policies()[0]):  # fields a torch lacks keep their default
        return MixedPrecisionPolicy(**{f.name: getattr(value, f.name)
                                       for f in fields(MixedPrecisionPolicy)
                                       if hasattr(value, f.name)})
    raise TypeError(f"fully_shard({label}): mp_policy must be a MixedPrecisionPolicy (fullshard's "
                    f"or torch.distributed.fsdp's), got {type(value).__name__}.")


def as_offload_policy(value, label: str) -> OffloadPolicy:
    """``value`` as fullshard's OffloadPolicy or CPUOffloadPolicy: ours, torch's, or None
    (no offloading, as torch's migration guide writes it)."""
    if value is None:
        return OffloadPolicy()
    if type(value) is DiskOffloadPolicy:
        return _checked_disk_policy(_checked_params_on_device(value, label), label)
    if type(value) is CPUOffloadPolicy:
        return _checked_params_on_device(value, label)
    if type(value) is OffloadPolicy:
        return value
    _, torch_offload, torch_cpu_offload = _torch_policies()
    if type(value) is torch_cpu_offload:
        return CPUOffloadPolicy(pin_memory=value.pin_memory)
    if type(value) is torch_offload:
        return OffloadPolicy()
    raise TypeError(f"fully_shard({label}): offload_policy must be OffloadPolicy(), "
                    "CPUOffloadPolicy() (fullshard's or torch.distributed.fsdp's), "
                    "DiskOffloadPolicy(path=...) or None, got "
                    f"{type(value).__name__}.")


def _checked_params_on_device(policy: CPUOffloadPolicy, label: str) -> CPUOffloadPolicy:
    """The policy, after checking ``params_on_device`` is a bool that does not contradict
    parameters kept on disk (E386)."""
    where = f"fully_shard({label}): {type(policy).__name__}"
    if not isinstance(policy.params_on_device, bool):
        raise ValueError(f"{where}: params_on_device must be True or False, got "
                         f"{policy.params_on_device!r}.")
    if policy.params_on_device and getattr(policy, "params", False):
        raise ValueError(f"{where}(params=True, params_on_device=True): the parameters cannot "
                         "be kept both in a file and on the device; keep params=True to page "
                         "them from disk, or params_on_device=True (params=False) to keep a "
                         "copy on the device beside the host's.")
    return policy


def _checked_disk_policy(policy: DiskOffloadPolicy, label: str) -> DiskOffloadPolicy:
    """The policy, after checking its directory can take the state files (E136), with
    its path made absolute."""
    where = f"fully_shard({label}): DiskOffloadPolicy(path={policy.path!r})"
    if not isinstance(policy.chunk_numel, int) or policy.chunk_numel <= 0:
        raise ValueError(f"{where}: chunk_numel must be a positive int, got "
                         f"{policy.chunk_numel!r}.")
    if not isinstance(policy.params, bool):
        raise ValueError(f"{where}: params must be True or False, got {policy.params!r}.")
    if not isinstance(policy.path, (str, os.PathLike)) or not str(policy.path):
        raise ValueError(f"{where}: path must name a directory on a local disk.")
    path = os.fspath(policy.path)
    if not os.path.isdir(path):
        raise ValueError(f"{where}: no such directory. Create it first, or name an "
                         "existing directory on a local disk (NVMe).")
    try:  # os.access says nothing of read-only mounts: create a file to know
        fd, probe = tempfile.mkstemp(prefix=".fullshard-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{where}: the directory is not writable ({e.strerror}). Name a "
                         "directory this process can write to.") from None
    # The state files are created at the first step: a relative path means the directory
    # it named here, not one under wherever the program has changed to by then.
    return replace(policy, path=os.path.abspath(path))


try:  # torch >= 2.13
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # older torch: the same fields, so code written for 2.13 runs
    @dataclass(frozen=True)
    class DataParallelMeshDims:  # type: ignore[no-redef]
        """Which named dimensions of ``mesh`` are data parallel (torch 2.13's type)."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self):
            if self.shard is None and self.replicate is None:
                raise ValueError("At least one of shard or replicate must be set in "
                                 "DataParallelMeshDims")
