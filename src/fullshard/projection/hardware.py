"""Devices, links and clusters: the hardware a projection runs on.

Every figure is a parameter a user can override (``fullshard project --efficiency``,
``--intra-gbps``, ``--inter-gbps`` ...). The defaults, and where each comes from:

- ``peak_flops``, ``memory_bandwidth``, ``memory_bytes``: the vendor's datasheet (dense
  bf16 tensor-core peak; memory as ``nvidia-smi`` reports it, MiB). A variant is a device of
  its own: the A100 with 40 GB of HBM2 (1.56 TB/s) or 80 GB of HBM2e (2.04 TB/s); the H100
  SXM (HBM3, 3.35 TB/s, 700 W), PCIe (756 TFLOP/s, 2.0 TB/s, 350 W, no NVLink switch) and
  the 96 GB HBM2e part run at 500 W in Meta's Grand Teton hosts (2.4 TB/s; a lower
  sustained clock under that cap was fitted, to no effect beyond its slower memory, on the
  one published run of that part); the H200 (HBM3e, 4.8 TB/s); the B200 (HGX, 1,000 W:
  2.25 PFLOP/s, 180 GB of HBM3e at 8 TB/s, NVLink 5) and AMD's MI300X (1,307 TFLOP/s, 192
  GB of HBM3 at 5.3 TB/s, Infinity Fabric), whose architectures no published run in the
  data has fitted: projecting them needs ``--efficiency`` or ``--calibrate`` on one
  (``compute_seconds`` refuses them otherwise, E393).
- how much of those a training step reaches is the compute model's business
  (compute.py, Note [the compute model]), fitted per architecture (``arch``) to published
  runs; ``efficiency``, when set, replaces it by one achieved fraction of peak on every
  executed FLOP (what ``--efficiency`` sets, and what a calibrated CPU uses).
- links: what NCCL achieves, not the nominal rate: NVLink 4 (H100/H200 SXM) ~360 GB/s of
  all-gather bus bandwidth per GPU, NVLink 3 (A100) ~230 GB/s, an H100 PCIe's PCIe 5 ~40
  GB/s; between nodes one 400 Gb/s NIC per GPU (H100/H200/B200/MI300X) or 200 Gb/s (A100)
  at ~90% (``inter`` is one GPU's NIC; ``Cluster.link_for`` says how rings spanning nodes
  use them). NVLink 5 (B200: 900 GB/s each way) and the MI300X's seven Infinity Fabric
  links (64 GB/s each way each) are taken at NVLink 4's measured share of its nominal rate
  (360 of 450 GB/s): 720 and 358 GB/s, assumed, not measured (``--intra-gbps`` sets them).
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
    peak_flops: float          # FLOP/s, dense, in the training's compute dtype (datasheet)
    memory_bytes: int          # usable device memory
    memory_bandwidth: float    # bytes/s (datasheet)
    arch: str = "cpu"          # which fitted kernel constants apply (compute.py); none for a CPU
    # set (or an arch without constants): one achieved fraction of peak for all compute (1)
    efficiency: float | None = None
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
MiB = 2**20
_NVLINK4, _NVLINK3 = Link(360 * GB, 10e-6), Link(230 * GB, 10e-6)
_NIC400, _NIC200 = Link(45 * GB, 20e-6), Link(22.5 * GB, 20e-6)
DEVICES: dict[str, Device] = {
    "h100": Device("h100", 989e12, 81559 * MiB, 3.35e12, "hopper", intra=_NVLINK4,
                   inter=_NIC400, source="H100 SXM 80 GB (HBM3, 700 W)"),
    "h100-pcie": Device("h100-pcie", 756e12, 81559 * MiB, 2.0e12, "hopper",
                        intra=Link(40 * GB, 10e-6), inter=_NIC400,
                        source="H100 PCIe 80 GB (HBM2e, 350 W)"),
    "h100-hbm2e": Device("h100-hbm2e", 989e12, 96 * GB, 2.4e12, "hopper",
                         intra=_NVLINK4, inter=_NIC400,
                         source="H100 SXM 96 GB (HBM2e) at 500 W, as in Grand Teton"),
    "h200": Device("h200", 989e12, 143771 * MiB, 4.8e12, "hopper", intra=_NVLINK4,
                   inter=_NIC400, source="H200 SXM 141 GB (HBM3e, 700 W)"),
    "a100": Device("a100", 312e12, 81920 * MiB, 2.039e12, "ampere", intra=_NVLINK3,
                   inter=_NIC200, source="A100 SXM 80 GB (HBM2e, 400 W)"),
    "a100-40gb": Device("a100-40gb", 312e12, 40960 * MiB, 1.555e12, "ampere",
                        intra=_NVLINK3, inter=_NIC200, source="A100 SXM 40 GB (HBM2, 400 W)"),
    # architectures without fitted constants: --efficiency or --calibrate (module docstring)
    "b200": Device("b200", 2250e12, 180 * GB, 8.0e12, "blackwell",
                   intra=Link(720 * GB, 10e-6), inter=_NIC400,
                   source="B200 HGX 180 GB (HBM3e, 1,000 W); no published run fits its rates"),
    "mi300x": Device("mi300x", 1307.4e12, 192 * GB, 5.3e12, "cdna3",
                     intra=Link(358 * GB, 10e-6), inter=_NIC400,
                     source="MI300X 192 GB (HBM3, 750 W); no published run fits its rates"),
}
ALIASES = {"a100-80gb": "a100", "h100-sxm": "h100", "h100-96gb": "h100-hbm2e"}


def device_named(name: str) -> Device:
    try:
        name = name.lower()
        return DEVICES[ALIASES.get(name, name)]
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
