"""What a person sees: the progress line, eval log lines, ``metrics.jsonl``.

Everything here runs on rank 0 only (the memory figures come from step_memory.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TextIO


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
