"""Tuning the host allocator (memory/allocator.py): a threshold that is not a positive
int is refused by name."""

import pytest


def test_tune_cpu_allocator_refuses_a_threshold_that_is_not_a_positive_int():
    from fullshard.memory import tune_cpu_allocator

    for bad in (0, -1, 4.0, "4MiB"):
        with pytest.raises(ValueError, match=r"tune_cpu_allocator: mmap_threshold_bytes must "
                                             r"be a positive int"):
            tune_cpu_allocator(bad)
