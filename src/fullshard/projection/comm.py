"""Collective times from an alpha-beta model of NCCL's (and gloo's) ring algorithms.

A ring over n ranks takes n - 1 steps. All-gather and reduce-scatter move (n - 1)/n of
the full buffer through each rank's link; all-reduce is a reduce-scatter followed by an
all-gather, twice that. Each step pays the link's latency (alpha); each byte its inverse
bandwidth (beta). Tree all-reduce (NCCL's choice for small messages across many nodes)
trades bandwidth for log(n) latency; at the sizes FSDP moves (megabytes per unit) the ring
term dominates, so the ring is the model. An all-to-all (expert parallelism's token
dispatch) sends each of the other n - 1 ranks its 1/n of a rank's buffer: (n - 1)/n of the
buffer through each link, one latency per peer.
"""

from __future__ import annotations

from .hardware import Link

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def collective_seconds(kind: str, full_bytes: float, ranks: int, link: Link) -> float:
    """Time of one collective over ``ranks`` ranks; ``full_bytes`` is the unsharded buffer
    (the all-gather's output, the reduce-scatter's input, the all-reduce's buffer, one
    rank's all-to-all input)."""
    if kind not in KINDS:
        raise ValueError(f"collective kind must be one of {KINDS}, got {kind!r}")
    if ranks <= 1 or full_bytes <= 0:
        return 0.0
    passes = 2 if kind == "all_reduce" else 1
    return passes * ((ranks - 1) * link.latency
                     + (ranks - 1) / ranks * full_bytes / link.bandwidth)
