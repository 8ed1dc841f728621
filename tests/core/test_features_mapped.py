"""fullshard.core.features.mapped: file-backed tensors whose pages go back after each use."""

import os

import pytest
import torch

from fullshard.core.features.mapped import mapped_empty, page_out
from support.mappings import mapping_rss


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_page_out_leaves_nothing_resident_after_a_multithreaded_write(tmp_path):
    """Pages written by torch's intra-op threads on another CPU wait in that CPU's batch of
    pages not yet on the LRU lists, where MADV_PAGEOUT cannot take them; page_out must
    still leave none of them in the process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        left = []
        for i in range(40):
            t = mapped_empty(64 * 1024, torch.float32, str(tmp_path), "test")
            t.copy_(torch.full((64 * 1024,), float(i)))  # parallel: over torch's grain size
            page_out(t)
            left.append(mapping_rss(t))
            assert float(t[-1]) == i  # the data comes back on the next touch
    finally:
        torch.set_num_threads(threads)
    assert left == [0] * 40, left
