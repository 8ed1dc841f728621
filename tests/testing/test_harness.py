"""The test harness itself: a rank that dies by a signal is reported with its stack."""

import ctypes

import pytest
import torch.distributed as dist

from fullshard.testing import run_distributed


def _segfault_on_rank_one():
    if dist.get_rank() == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return dist.get_rank()


@pytest.mark.slow
def test_a_segfaulting_rank_reports_where_it_died():
    with pytest.raises(AssertionError) as info:
        run_distributed(_segfault_on_rank_one, 2, timeout=30)
    report = str(info.value)
    assert "--- rank 1 ---" in report and "exited with code -11" in report
    assert "where it died" in report and "_segfault_on_rank_one" in report
