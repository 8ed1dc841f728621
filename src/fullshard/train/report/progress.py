"""The progress line on rank 0's stderr: step, loss, tokens/s, the step's peak memory of
the largest rank, elapsed time and ETA, drawn by tqdm.

On a terminal tqdm rewrites one line in place and keeps the messages written through
:meth:`ProgressLine.message` (evaluations, checkpoints) above it. Elsewhere (a log file,
a pipe, a job scheduler's capture) a carriage-return bar is unreadable, so each step is a
line of its own with the same text, formatted by tqdm's ``format_meter``.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

# ``{desc}`` carries the step and this step's figures; tqdm adds the times.
BAR_FORMAT = "step {desc}  elapsed {elapsed}  eta {remaining}"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


class ProgressLine:
    """Steps ``first_step`` .. ``last_step`` of a run on ``stream``."""

    def __init__(self, first_step: int, last_step: int, stream: TextIO = sys.stderr):
        self.stream = stream
        self.first_step, self.last_step = first_step, last_step
        self.interactive = stream.isatty()
        self.start = time.perf_counter()
        self.bar: tqdm | None = None  # on a terminal, from the first step on


    def update(self, step: int, loss: float, tokens_per_s: float, peak_mem: int) -> None:
        """Step ``step``'s line; ``peak_mem``: the largest rank's peak (bytes)."""
        width = len(str(self.last_step))
        figures = (f"{step:>{width}}/{self.last_step}  loss {loss:.4f}  "
                   f"{tokens_per_s:,.0f} tok/s  peak/rank max {_mib(peak_mem)}")
        if self.interactive:
            if self.bar is None:
                self.bar = tqdm(total=self.last_step, initial=self.first_step - 1,
                                file=self.stream, bar_format=BAR_FORMAT, dynamic_ncols=True)
            self.bar.set_description_str(figures, refresh=False)
            self.bar.update(step - self.bar.n)
            return
        self.stream.write(tqdm.format_meter(
            step, self.last_step, time.perf_counter() - self.start, prefix=figures,
            bar_format=BAR_FORMAT, initial=self.first_step - 1) + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (eval results, checkpoints) that the progress line does not
        overwrite."""
        tqdm.write(text, file=self.stream)
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
