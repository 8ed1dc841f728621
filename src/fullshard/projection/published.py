"""The published FSDP runs the projection is fitted to and judged on
(``published_runs.csv``; docs/projection.md names each source).

Each row is one run as its source reports it: the model's shape, the GPUs (variant, count,
network), the strategy, micro-batch, accumulation, sequence length, activation
checkpointing, the attention kernel's generation (``flash1``: FlashAttention 1 or its Triton
port; ``flash2``: FlashAttention-2, SDPA), what torch.compile wrapped (``compile``: ``none``,
``blocks`` or ``model``), the blocks' elementwise kernels (``kernels``: PyTorch's ``eager``
ones or hand-written ``fused`` ones), reduction dtype, and the tokens/s per GPU measured.
``split`` says whether the row fits the compute model's constants or only judges them; the
rule, applied before any fitting: within each (team, GPU) group, rows ordered by the
SHA-256 of their ``id`` alternate fit, held-out, fit, ... (``split_of``).
"""

from __future__ import annotations

import csv
import hashlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .compute import FITTED, KernelConstants
from .hardware import Cluster, Link, ProjectionError, device_named
from .project import Projection, project
from .settings import COMPILE, KERNELS, Settings
from .shapes import ModelShape

RUNS = Path(__file__).with_name("published_runs.csv")
NIC_EFFICIENCY = 0.9  # what NCCL reaches of a NIC's line rate (hardware.py)


@dataclass(frozen=True)
class PublishedRun:
    id: str
    team: str
    split: str
    shape: ModelShape
    cluster: Cluster
    settings: Settings
    tokens_per_second: float   # per GPU, as published
    memory_gib: float | None   # peak memory per GPU, where published

    def projection(self, constants: KernelConstants = FITTED) -> Projection:
        return project(self.shape, self.cluster, self.settings, constants)

    def error(self, constants: KernelConstants = FITTED) -> float:
        """Projected over published tokens/s per GPU, minus one."""
        return self.projection(constants).tokens_per_second_per_device \
            / self.tokens_per_second - 1


def _choice(row: dict, column: str, values: tuple[str, ...], what: str) -> str:
    """``row``'s ``column``, refused by row and column when it is not one of ``values``
    (a typo would silently project, say, a compiled run as an eager one)."""
    value = (row.get(column) or "").strip()
    if value not in values:
        raise ProjectionError(f"published run {row['id']}: column {column} must be one of "
                              f"{', '.join(values)} ({what}), got {value!r}; correct that row")
    return value


def _settings(row: dict) -> Settings:
    ac, every = row["checkpointing"], 1
    if ac.startswith("every:"):
        ac, every = "full", int(ac.split(":")[1])
    ac = {"op": "selective"}.get(ac, ac)
    return Settings(row["strategy"], int(row["micro_batch"]), int(row["seq"]),
                    int(row["grad_accum"]), ac, param_bytes=2,
                    reduce_bytes=2 if row["reduce_dtype"] == "bf16" else 4,
                    checkpoint_every=every, sync_micro_batches=True,
                    fused_loss=row["loss"] == "fused", attention=row["attention"],
                    compile=_choice(row, "compile", COMPILE, "what torch.compile wrapped"),
                    kernels=_choice(row, "kernels", KERNELS, "the blocks' elementwise kernels"))


def _run(row: dict) -> PublishedRun:
    shape = ModelShape(row["model"], int(row["d_model"]), int(row["layers"]),
                       int(row["heads"]), int(row["kv_heads"]), int(row["ffn"]),
                       int(row["vocab"]), row["tied"] == "yes", row["mlp"] == "swiglu",
                       learned_positions=int(row["positions"]))
    device = device_named(row["gpu"])
    if row["inter_gbps_per_gpu"]:
        device = device.with_overrides(inter=Link(
            float(row["inter_gbps_per_gpu"]) / 8 * 1e9 * NIC_EFFICIENCY, device.inter.latency))
    cluster = Cluster(device, int(row["gpus"]), min(int(row["per_node"]), int(row["gpus"])))
    return PublishedRun(row["id"], row["team"], row["split"], shape, cluster, _settings(row),
                        float(row["tokens_per_s_per_gpu"]),
                        float(row["memory_gib"]) if row["memory_gib"] else None)


def load(path: Path = RUNS) -> list[PublishedRun]:
    with open(path, newline="") as f:
        return [_run(row) for row in csv.DictReader(f)]


def split_of(rows: list[dict]) -> dict[str, str]:
    """The split rule (module docstring): {id: "fit" or "held-out"}."""
    groups = defaultdict(list)
    for row in rows:
        groups[(row["team"], row["gpu"])].append(row["id"])
    out = {}
    for ids in groups.values():
        ids.sort(key=lambda i: hashlib.sha256(i.encode()).hexdigest())
        out.update({i: "fit" if n % 2 == 0 else "held-out" for n, i in enumerate(ids)})
    return out
