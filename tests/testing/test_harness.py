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


def _abort_on_rank_one_after_a_line():
    import os

    if dist.get_rank() == 1:
        os.write(2, b"terminate called after throwing an instance of 'boom'\n")
        os.abort()
    return dist.get_rank()


def _print_to_stderr():
    import sys

    print(f"hello from {dist.get_rank()}", file=sys.stderr)
    return dist.get_rank()


@pytest.mark.slow
def test_an_aborting_rank_reports_what_it_printed_last():
    """An abort from a C++ thread leaves no Python traceback: the rank's last stderr lines
    (the runtime's 'terminate called ...') say why."""
    with pytest.raises(AssertionError) as info:
        run_distributed(_abort_on_rank_one_after_a_line, 2, timeout=30)
    report = str(info.value)
    assert "exited with code -6" in report
    assert "terminate called after throwing an instance of 'boom'" in report


@pytest.mark.slow
def test_what_ranks_print_to_stderr_reaches_the_callers_stderr(capfd):
    assert run_distributed(_print_to_stderr, 2, timeout=30) == [0, 1]
    err = capfd.readouterr().err
    assert "[rank 0] hello from 0" in err and "[rank 1] hello from 1" in err
