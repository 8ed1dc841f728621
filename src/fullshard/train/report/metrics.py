"""``metrics.jsonl``, and the memory figures in it and in the progress line.

The log runs on rank 0 only (as do the progress line, ``progress.py``, the plot,
``plot.py``, and the dashboards, ``dashboards.py``); the memory figures come from
:class:`StepMemory`, on every rank.

Each step's memory per rank, measured by ``fullshard.memory.MemoryTracker`` and reported
at its largest over ranks (every rank's peak too on the run's first step and on the
steps that evaluate or save), and the estimate of the run's configuration printed beside
the first measurement.

A step runs its micro-batches' forward and backward and then the optimizer inside the
tracker's phases; the phase peaks are reset at every phase start (CPU: the RSS
high-water mark; CUDA: ``max_memory_allocated``), so a step's figures are that step's
own, not the process's peak since it started. That costs ~0.2 ms a step on CPU.
fullshard's own buffers (sharded and gathered parameters, gradients, pooled communication
buffers) are sampled at phase edges and before each unit's forward: ~0.05 ms a sample
(over the units and parameters the tracker listed once), ~0.3 ms a step for the debug
preset, 3% of its step time. So they are sampled on every ``BUFFERS_EVERY``-th step only.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

import torch
import torch.nn as nn

from ...memory import MemoryTracker, estimate
from ..config.schema import TrainConfig, offload_kind
from ..model import COMPUTE_DTYPES


class MetricsLog:
    """``OUT/metrics.jsonl``: one JSON object per line, flushed as written. A fresh run
    truncates it; a resumed one drops lines past the checkpoint's step (written after
    it by the interrupted run) and appends."""

    def __init__(self, path: str, resume_step: int | None):
        self.path = path
        kept = [] if resume_step is None else [r for r in read_metrics(path)
                                               if r["step"] <= resume_step]
        self.records: list[dict] = kept
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self._file = open(path, "a")

    def write(self, record: dict) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# -- memory per step -------------------------------------------------------------------

PHASES = ("forward", "backward", "optimizer")
# What every rank reports each step, in this order (bytes); the loop reduces them.
FIGURES = ("peak", *PHASES, "fullshard_buffers")
BUFFERS_EVERY = 10
NOT_SAMPLED = -1


class StepMemory:
    """This rank's tracker. Create it on every rank before the model exists: its warm-up
    is collective, and its baseline is then the process without the model."""

    def __init__(self, device: torch.device):
        self.tracker = MemoryTracker(device, warm_up=True)
        self.model: nn.Module | None = None
        self.sampling_buffers = False

    @property
    def baseline_bytes(self) -> int:
        return self.tracker.baseline_bytes

    def watch(self, model: nn.Module) -> None:
        self.model = model

    def begin_step(self, step: int) -> None:
        """Sample fullshard's buffers in step ``step`` if it is a sampled one."""
        sample = step % BUFFERS_EVERY == 0
        if sample and not self.sampling_buffers:
            self.tracker.watch(self.model)
        elif not sample and self.sampling_buffers:
            self.tracker.unwatch()
        self.sampling_buffers = sample

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with self.tracker.phase(name):
            yield

    def step_figures(self) -> list[int]:
        """This step's figures in ``FIGURES`` order; the next step starts afresh."""
        report = self.tracker.step_report()
        phases = report["phases"]
        peaks = [phases.get(name, {}).get("peak_bytes", 0) for name in PHASES]
        # Per phase each kind of buffer at its largest, summed; the largest phase.
        buffers = max((sum(p["fullshard"].values()) for p in phases.values()), default=0) \
            if self.sampling_buffers else NOT_SAMPLED
        return [report["peak_bytes"], *peaks, buffers]


def metrics_fields(largest: torch.Tensor, peaks: list[int] | None = None) -> dict:
    """metrics.jsonl fields from the ``FIGURES``, each the largest over ranks; figures not
    sampled this step are left out. ``peaks``, every rank's peak on the steps that gather
    them (train/step_stats.py), as ``peak_mem_bytes_per_rank``."""
    values = [int(v) for v in largest.tolist()]  # one conversion, not one per element
    fields = {"peak_mem_bytes": values[0]}
    if peaks is not None:
        fields["peak_mem_bytes_per_rank"] = peaks
    for name, value in zip(FIGURES[1:], values[1:]):
        if value != NOT_SAMPLED:
            fields[f"mem_{name}_bytes"] = value
    return fields


def estimated_peak_bytes(cfg: TrainConfig, world: int, device: torch.device,
                         baseline_bytes: int | None) -> int | None:
    """``fullshard.memory.estimate``'s peak per rank for this run, or None where the
    estimator does not model the configuration (hybrid_shard's 2-D sharding, a Hugging
    Face model its meta-device trace cannot run)."""
    parallel = cfg.parallel
    if parallel.strategy == "hybrid_shard":
        return None
    # no_shard runs on shard groups of one rank, where reshard_after_forward changes
    # nothing; the estimator reads an explicit value as a request to shard.
    reshard = None if parallel.strategy == "no_shard" else parallel.reshard_after_forward
    source = cfg.hf_path if cfg.is_hf else cfg.gpt
    try:
        result = estimate(source, world_size=world, strategy=parallel.strategy,
                          reshard_after_forward=reshard,
                          mp_policy=COMPUTE_DTYPES[parallel.precision],
                          activation_checkpointing=parallel.activation_checkpointing,
                          offload=offload_kind(parallel.offload, parallel.offload_params), batch_size=cfg.batch.batch_size,
                          seq_len=cfg.batch.seq_len,
                          optimizer="adamw", device=device.type,
                          process_baseline=baseline_bytes, lora_rank=cfg.lora.rank,
                          quantize_comm=parallel.quantize, ep=parallel.ep,
                          params_on_device=parallel.params_on_device,
                          quantize="nf4" if cfg.lora.rank and cfg.lora.base == "nf4"
                          else None)
    except Exception:  # noqa: BLE001 - a Hugging Face architecture the trace cannot run
        if not cfg.is_hf:  # the GPT is always estimable: a failure there is a bug
            raise
        return None  # the line is a diagnostic: it must not stop a fine-tuning run
    return result.total


def expected_memory_line(cfg: TrainConfig, preset: str, world: int, device_type: str
                         ) -> str | None:
    """The launcher's line for a GPU preset: ``fullshard.memory.estimate``'s peak per
    rank for the resolved configuration at ``world`` ranks (None where not estimable)."""
    peak = estimated_peak_bytes(cfg, world, torch.device(device_type),
                                0 if device_type == "cuda" else None)
    if peak is None:
        return None
    where = "per GPU" if device_type == "cuda" else "per rank (CPU)"
    return (f"{preset}: expected peak memory {peak / 2**30:,.1f} GiB {where} at {world} "
            f"ranks, {cfg.parallel.precision}, micro-batch {cfg.batch.batch_size} x "
            f"{cfg.batch.seq_len} (fullshard.memory.estimate for this configuration)")


def estimate_line(estimated: int, measured: int, first_step: int, last_step: int) -> str:
    error = (estimated - measured) / measured * 100 if measured else float("nan")
    return (f"memory: estimated peak {estimated / 2**20:,.0f} MiB per rank "
            f"(fullshard.memory.estimate); measured {measured / 2**20:,.0f} MiB (largest "
            f"rank, steps {first_step}-{last_step}): estimate {error:+.1f}%")
