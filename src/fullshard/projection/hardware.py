"""Devices, links and clusters: the hardware a projection runs on.

Every figure is a parameter a user can override (``fullshard project --efficiency``,
``--intra-gbps``, ``--inter-gbps`` ...). The defaults, and where each comes from:

- ``peak_flops``: the vendor's dense bf16 tensor-core figure (H100/H200 SXM 989 TFLOP/s,
  A100 312 TFLOP/s).
- ``efficiency``: the fraction of ``peak_flops`` an eager bf16 transformer training step
  achieves on the FLOPs it really executes (recomputation included). It is not derivable
  from a datasheet, so each default is fitted once to one published run, named in
  ``source``, and then checked against *other* published runs (docs/projection.md,
  tests/test_projection.py): H100 from torchtitan's Llama 3.1 8B on 8 H100s (5,762
  tokens/s/GPU), A100 from torchtitan's Llama 3 8B on 64 A100s (2,973 tokens/s/GPU).
- links: what NCCL achieves, not the nominal rate: NVLink 4 (H100/H200) ~360 GB/s of
  all-gather bus bandwidth per GPU, NVLink 3 (A100) ~230 GB/s; between nodes one
  400 Gb/s NIC per GPU (H100/H200) or 200 Gb/s (A100) at ~90% (``inter`` is one GPU's
  NIC; ``Cluster.link_for`` says how rings spanning nodes use them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class ProjectionError(ValueError):
    """A projection input that cannot describe real hardware or a real run; one line."""


@dataclass(frozen=True)
class Link:
    """One rank's share of a link: bytes/s it can send while receiving as many."""

    bandwidth: float
    latency: float  # seconds per step of a ring


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float          # FLOP/s, dense, in the training's compute dtype
    efficiency: float          # achieved fraction of peak_flops on executed FLOPs
    memory_bytes: int          # usable device memory
    memory_bandwidth: float    # bytes/s (the optimizer step streams the shard through it)
    # GPUs run collectives beside kernels (NCCL on its own streams): communication can hide
    # under compute. A CPU rank whose cores are all busy computing cannot: it serializes.
    overlaps_comm: bool = True
    cores: int = 0             # CPU only: ranks beyond this many share cores
    intra: Link = Link(1.0, 0.0)
    inter: Link = Link(1.0, 0.0)
    source: str = ""

    def with_overrides(self, **fields) -> "Device":
        return replace(self, **{k: v for k, v in fields.items() if v is not None})


GB = 1e9
DEVICES: dict[str, Device] = {
    "h100": Device("h100", 989e12, 0.3807, 80 * GB, 3.35e12,
                   intra=Link(360 * GB, 10e-6), inter=Link(45 * GB, 20e-6),
                   source="efficiency fitted to torchtitan Llama 3.1 8B, 8 H100, 5,762 "
                          "tokens/s/GPU (docs/performance.md)"),
    "h200": Device("h200", 989e12, 0.3807, 141 * GB, 4.8e12,
                   intra=Link(360 * GB, 10e-6), inter=Link(45 * GB, 20e-6),
                   source="H100's efficiency (same compute die); more and faster memory"),
    "a100": Device("a100", 312e12, 0.6254, 80 * GB, 2.04e12,
                   intra=Link(230 * GB, 10e-6), inter=Link(22.5 * GB, 20e-6),
                   source="efficiency fitted to torchtitan Llama 3 8B, 64 A100, 2,973 "
                          "tokens/s/GPU (docs/performance.md)"),
}


def device_named(name: str) -> Device:
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ProjectionError(
            f"unknown device {name!r}: one of {', '.join(DEVICES)}, or calibrate the machine "
            "at hand with `fullshard project --calibrate`") from None


@dataclass(frozen=True)
class Cluster:
    """``world_size`` ranks, ``per_node`` of them on each node."""

    device: Device
    world_size: int
    per_node: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.per_node < 1:
            raise ProjectionError(f"a cluster needs at least one rank and one rank per node, "
                                  f"got {self.world_size} ranks, {self.per_node} per node")
        if self.world_size > self.per_node and self.world_size % self.per_node:
            raise ProjectionError(f"{self.world_size} ranks do not fill nodes of "
                                  f"{self.per_node}: use a multiple of {self.per_node}")

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.per_node)

    def link_for(self, spans_nodes: bool, ranks_per_node: int = 0) -> Link:
        """The link a ring over ``group_size`` ranks runs at. Inside a node: NVLink. Across
        nodes, NCCL runs one ring per NIC, so a ring's data enters each node once and
        spreads over NVLink: the node's NICs together carry it (nccl-tests' inter-node
        bus bandwidth is close to the sum of a node's NICs), up to NVLink's own rate.
        ``ranks_per_node``: the group's ranks on each node (0: a full node; HYBRID_SHARD's
        replica groups have one, so each runs on one NIC)."""
        if not spans_nodes:
            return self.device.intra
        ranks_per_node = ranks_per_node or self.per_node
        return Link(min(self.device.intra.bandwidth,
                        self.device.inter.bandwidth * ranks_per_node),
                    self.device.inter.latency)
