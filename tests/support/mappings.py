"""How much of one memory mapping is resident, read from ``/proc/self/smaps``: the
measure of a file-backed shard's pages, which the process's total resident memory hides
among the heap's comings and goings."""

from __future__ import annotations

import torch


def mapping_rss(t: torch.Tensor) -> int:
    """Resident bytes of the mapping that holds ``t``."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")
