"""The two test lanes: the CPU lane (``make test``) and the CUDA lane (``make test-gpu``).

The CPU lane's tests compare against CPU references, launch gloo ranks and expect the
error texts of a machine without CUDA. On a machine with a GPU, torch would otherwise
pick it in places (the trainer's NCCL ranks, FSDP1's device checks, HYBRID_SHARD's ranks
per node, the memory tracker), so ``tests/conftest.py`` hides CUDA from the CPU lane:
``CUDA_VISIBLE_DEVICES`` is emptied before torch first asks CUDA anything, and every
process the tests start (ranks, the trainer's workers) inherits it. The CUDA lane
(``tests/gpu``, ``FULLSHARD_TEST_LANE=cuda``) leaves the GPUs visible and runs only
where one is.
"""

from __future__ import annotations

import sys
from typing import Callable, MutableMapping

LANE_VARIABLE = "FULLSHARD_TEST_LANE"
CUDA_LANE = "cuda"


def is_cuda_lane(environ: MutableMapping[str, str]) -> bool:
    return environ.get(LANE_VARIABLE) == CUDA_LANE


def hide_cuda(environ: MutableMapping[str, str]) -> None:
    """Make CUDA invisible to torch in this process and every process started from it."""
    environ["CUDA_VISIBLE_DEVICES"] = ""


def cuda_was_already_initialized() -> bool:
    """Whether torch set up CUDA in this process before the lane could hide it (then
    hiding comes too late: the CUDA runtime reads ``CUDA_VISIBLE_DEVICES`` once)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def cuda_lane_skip_reason(environ: MutableMapping[str, str],
                          cuda_devices: Callable[[], int]) -> str | None:
    """Why the CUDA lane cannot run here, or None when it can. ``cuda_devices`` is asked
    only in the CUDA lane (in the CPU lane CUDA is hidden anyway)."""
    if not is_cuda_lane(environ):
        return (f"the CUDA lane runs under `make test-gpu` ({LANE_VARIABLE}={CUDA_LANE}); "
                "the CPU lane hides CUDA")
    n = cuda_devices()
    if n < 1:
        return "the CUDA lane needs a CUDA GPU: torch sees none here"
    return None


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_cuda_lane() -> None:
    """Skip the calling test module unless the CUDA lane runs with a GPU; every module
    skipped here reports this line (pytest folds them into one)."""
    import os

    import pytest

    reason = cuda_lane_skip_reason(os.environ, visible_cuda_devices)
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
