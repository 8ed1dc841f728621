"""Runs PyTorch's own FSDP2 tests on CPU ranks over gloo, with fullshard behind torch's names.

Applied in every process of the suite: the pytest process (threaded tests) through
``torch_suite/conftest.py``, and each rank ``MultiProcessTestCase`` spawns through
``shim/sitecustomize.py`` (a spawned rank imports the test file afresh, so the
conftest's patches would not reach it). ``FULLSHARD_TORCH_SUITE_NATIVE=1`` leaves
torch's own FSDP2 in place: the same tests against torch itself, the control.

What it changes, in torch's test helpers only:
- ``skip_if_lt_x_gpu(n)`` runs the test on ``n`` CPU ranks instead of skipping
  (up to ``CPU_RANKS``); the test bases see ``CPU_RANKS`` "devices", so a test's
  ``world_size`` that reads the device count gets CPU ranks.
- nothing in a test file: the files are torch's, byte for byte.
"""

from __future__ import annotations

import functools
import os

# How many CPU ranks stand in for "devices" (the tests ask for at most 8).
CPU_RANKS = int(os.environ.get("FULLSHARD_TORCH_SUITE_RANKS", "8"))


def native() -> bool:
    return os.environ.get("FULLSHARD_TORCH_SUITE_NATIVE") == "1"


def _cpu_skip_if_lt_x_gpu(x, *, allow_cpu=False):
    """torch's decorator, with CPU ranks counting as devices."""
    import sys

    from torch.testing._internal import common_distributed as cd

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if x <= CPU_RANKS:
                return func(*args, **kwargs)
            test_skip = cd.TEST_SKIPS[f"multi-gpu-{x}"]
            if not cd._maybe_handle_skip_if_lt_x_gpu(args, test_skip.message):
                sys.exit(test_skip.exit_code)

        return wrapper

    return decorator


def apply() -> None:
    """Patch torch's test helpers for CPU ranks; install fullshard unless native."""
    import torch
    from torch.testing._internal import common_distributed, common_fsdp

    common_distributed.skip_if_lt_x_gpu = _cpu_skip_if_lt_x_gpu
    common_fsdp.DEVICE_COUNT = CPU_RANKS
    # The test bases compare the world size with the device count before starting a rank;
    # tests size their world from the CPU device module's count.
    torch.accelerator.device_count = lambda: CPU_RANKS
    torch.cpu.device_count = lambda: CPU_RANKS
    if not native():
        import fullshard

        fullshard.install()
