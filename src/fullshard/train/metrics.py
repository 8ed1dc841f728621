"""What a person sees: the progress line, eval log lines, ``metrics.jsonl``, ``loss.png``;
and the memory figures in them.

The progress line, the log and the plot run on rank 0 only; the memory figures come from
:class:`StepMemory`, on every rank.

Each step's memory per rank, measured by ``fullshard.memory.MemoryTracker``, and the
estimate of the run's configuration printed beside the first measurement.

A step runs its micro-batches' forward and backward and then the optimizer inside the
tracker's phases; the phase peaks are reset at every phase start (CPU: the RSS
high-water mark; CUDA: ``max_memory_allocated``), so a step's figures are that step's
own, not the process's peak since it started. That costs ~0.2 ms a step on CPU.
fullshard's own buffers (sharded and gathered parameters, gradients, pooled communication
buffers) are sampled at phase edges and before each unit's forward: ~0.05 ms a sample
(over the units and parameters the tracker listed once), ~0.3 ms a step for the debug
preset, 3% of its step time. So they are sampled on every ``BUFFERS_EVERY``-th step only.

``loss.png``: train and validation loss against step, drawn without dependencies. A line
plot needs little: a pixel buffer, straight lines, a few digits and letters (a 5x7 bitmap
font) and PNG's encoding (zlib + CRC-framed chunks, both in the standard library). Drawing
it here keeps matplotlib (and its ~40 MB of dependencies and a second of import time on
every rank) out of the trainer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import sys
import time
import zlib
from typing import Iterator, TextIO

import torch
import torch.nn as nn

from ..memory import MemoryTracker, estimate
from .config import TrainConfig
from .model import COMPUTE_DTYPES


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


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}:{seconds % 60:02d}"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


class ProgressLine:
    """One status line on stderr rewritten in place (carriage return) on a terminal;
    elsewhere (logs, pipes) a plain line every ``every_when_piped`` steps."""

    def __init__(self, first_step: int, last_step: int, stream: TextIO = sys.stderr,
                 every_when_piped: int = 10):
        self.stream = stream
        self.first_step, self.last_step = first_step, last_step
        self.interactive = stream.isatty()
        self.every_when_piped = every_when_piped
        self.start = time.perf_counter()
        self._open = False

    def update(self, step: int, loss: float, tokens_per_s: float, peak_mem: list[int]) -> None:
        done = step - self.first_step + 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.last_step - step)
        width = len(str(self.last_step))
        mem = " ".join(_mib(m) for m in peak_mem) if len(peak_mem) <= 4 else \
            f"max {_mib(max(peak_mem))}"
        text = (f"step {step:>{width}}/{self.last_step}  loss {loss:.4f}  "
                f"{tokens_per_s:,.0f} tok/s  peak/rank {mem}  "
                f"elapsed {_duration(elapsed)}  eta {_duration(eta)}")
        if self.interactive:
            self.stream.write("\r" + text + "\x1b[K")
            self._open = True
        elif step % self.every_when_piped == 0 or step == self.last_step:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (eval results, checkpoints) that the status line does not
        overwrite."""
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


# -- memory per step -------------------------------------------------------------------

PHASES = ("forward", "backward", "optimizer")
# What every rank reports each step, in this order (bytes); the loop gathers them.
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


def metrics_fields(per_rank: torch.Tensor) -> dict:
    """metrics.jsonl fields from the gathered ``world x len(FIGURES)`` figures: each the
    largest over ranks, the peak also per rank; figures not sampled this step are left
    out."""
    largest = per_rank.max(dim=0).values
    fields = {"peak_mem_bytes": int(largest[0]),
              "peak_mem_bytes_per_rank": [int(b) for b in per_rank[:, 0]]}
    for i, name in enumerate(FIGURES[1:], start=1):
        if largest[i] != NOT_SAMPLED:
            fields[f"mem_{name}_bytes"] = int(largest[i])
    return fields


def estimated_peak_bytes(cfg: TrainConfig, world: int, device: torch.device,
                         baseline_bytes: int) -> int | None:
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
                          offload=parallel.offload, batch_size=cfg.batch.batch_size,
                          seq_len=cfg.batch.seq_len,
                          optimizer="adamw", device=device.type,
                          process_baseline=baseline_bytes)
    except Exception:  # noqa: BLE001 - a Hugging Face architecture the trace cannot run
        if not cfg.is_hf:  # the GPT is always estimable: a failure there is a bug
            raise
        return None  # the line is a diagnostic: it must not stop a fine-tuning run
    return result.total


def estimate_line(estimated: int, measured: int, first_step: int, last_step: int) -> str:
    error = (estimated - measured) / measured * 100 if measured else float("nan")
    return (f"memory: estimated peak {estimated / 2**20:,.0f} MiB per rank "
            f"(fullshard.memory.estimate); measured {measured / 2**20:,.0f} MiB (largest "
            f"rank, steps {first_step}-{last_step}): estimate {error:+.1f}%")


# -- loss.png --------------------------------------------------------------------------

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (225, 225, 225)
TRAIN_COLOR: Color = (31, 119, 180)
VAL_COLOR: Color = (255, 127, 14)

# 5x7 glyphs, one int per row, bit 4 the leftmost pixel.
FONT = {
    "0": (14, 17, 19, 21, 25, 17, 14), "1": (4, 12, 4, 4, 4, 4, 14),
    "2": (14, 17, 1, 2, 4, 8, 31), "3": (31, 2, 4, 2, 1, 17, 14),
    "4": (2, 6, 10, 18, 31, 2, 2), "5": (31, 16, 30, 1, 1, 17, 14),
    "6": (6, 8, 16, 30, 17, 17, 14), "7": (31, 1, 2, 4, 8, 8, 8),
    "8": (14, 17, 17, 14, 17, 17, 14), "9": (14, 17, 17, 15, 1, 2, 12),
    ".": (0, 0, 0, 0, 0, 12, 12), "-": (0, 0, 0, 31, 0, 0, 0), " ": (0,) * 7,
    "a": (0, 0, 14, 1, 15, 17, 15), "e": (0, 0, 14, 17, 31, 16, 14),
    "i": (4, 0, 12, 4, 4, 4, 14), "l": (12, 4, 4, 4, 4, 4, 14),
    "n": (0, 0, 22, 25, 17, 17, 17), "o": (0, 0, 14, 17, 17, 17, 14),
    "p": (0, 0, 30, 17, 30, 16, 16), "r": (0, 0, 22, 25, 16, 16, 16),
    "s": (0, 0, 14, 16, 14, 1, 30), "t": (8, 8, 28, 8, 8, 9, 6),
    "v": (0, 0, 17, 17, 17, 10, 4),
}
SCALE = 2            # font pixels are SCALE x SCALE
ADVANCE = 6 * SCALE  # glyph width plus one column of spacing


class Canvas:
    """An RGB pixel buffer that writes itself as PNG."""

    def __init__(self, width: int, height: int, background: Color = WHITE):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(y0, y1 + 1):
            for x in range(x0, x1 + 1):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thick: int = 1) -> None:
        """Bresenham's line; ``thick`` > 1 repeats it shifted down and right."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for t in range(thick):
                self.set(x0 + t, y0, color)
                self.set(x0, y0 + t, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK) -> None:
        """``text`` with its top-left corner at (x, y); characters without a glyph are
        left blank."""
        for k, char in enumerate(text):
            for row, bits in enumerate(FONT.get(char, FONT[" "])):
                for col in range(5):
                    if bits >> (4 - col) & 1:
                        px, py = x + k * ADVANCE + col * SCALE, y + row * SCALE
                        self.rect(px, py, px + SCALE - 1, py + SCALE - 1, color)

    def png(self) -> bytes:
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride])
                       for y in range(self.height))  # filter type 0 on every row

        def chunk(kind: bytes, data: bytes) -> bytes:
            return (struct.pack(">I", len(data)) + kind + data
                    + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values (steps of 1, 2 or 5 x 10^k) covering [low, high]."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{value:.{decimals}f}"


def plot_losses(path: str, train: list[tuple[int, float]], val: list[tuple[int, float]],
                width: int = 640, height: int = 400) -> None:
    """Write a PNG of ``train`` and ``val`` (lists of (step, loss)) to ``path``."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 50
    points = train + val
    if points:
        x_low, x_high = min(p[0] for p in points), max(p[0] for p in points)
        y_low, y_high = min(p[1] for p in points), max(p[1] for p in points)
    else:
        x_low, x_high, y_low, y_high = 0, 1, 0.0, 1.0
    x_ticks, y_ticks = nice_ticks(x_low, x_high), nice_ticks(y_low, y_high)
    x_low, x_high = min(x_low, x_ticks[0]), max(x_high, x_ticks[-1], x_low + 1)
    y_low, y_high = min(y_low, y_ticks[0]), max(y_high, y_ticks[-1], y_low + 1e-6)

    def to_pixel(step: float, loss: float) -> tuple[int, int]:
        px = left + (step - x_low) / (x_high - x_low) * (right - left)
        py = bottom - (loss - y_low) / (y_high - y_low) * (bottom - top)
        return round(px), round(py)

    for value in y_ticks:
        _, py = to_pixel(x_low, value)
        canvas.line(left, py, right, py, GRID)
        label = _label(value, y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0)
        canvas.text(left - 8 - len(label) * ADVANCE, py - 7, label)
    for value in x_ticks:
        px, _ = to_pixel(value, y_low)
        canvas.line(px, top, px, bottom, GRID)
        label = f"{value:.0f}"
        canvas.text(px - len(label) * ADVANCE // 2, bottom + 8, label)
    canvas.line(left, top, left, bottom, BLACK)
    canvas.line(left, bottom, right, bottom, BLACK)
    canvas.text((left + right) // 2 - 2 * ADVANCE, height - 18, "step")
    canvas.text(8, 8, "loss")
    for series, color in ((train, TRAIN_COLOR), (val, VAL_COLOR)):
        pixels = [to_pixel(s, v) for s, v in series]
        for (x0, y0), (x1, y1) in zip(pixels, pixels[1:]):
            canvas.line(x0, y0, x1, y1, color, thick=2)
        if series is val:
            for x, y in pixels:  # evaluations are few: mark each one
                canvas.rect(x - 3, y - 3, x + 3, y + 3, color)
    for k, (name, color) in enumerate((("train", TRAIN_COLOR), ("val", VAL_COLOR))):
        x, y = right - 100, top + 6 + k * 20
        canvas.rect(x, y + 4, x + 16, y + 8, color)
        canvas.text(x + 24, y, name)
    with open(path + ".partial", "wb") as f:
        f.write(canvas.png())
    os.replace(path + ".partial", path)  # a viewer never sees half a file
