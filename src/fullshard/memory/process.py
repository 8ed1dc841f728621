"""What the operating system says about this process's memory (Linux ``/proc``).

On CPU the figure that matters is resident memory: ``VmRSS`` now and ``VmHWM``
(its high-water mark) since the process started or since ``reset_peak_rss``.
With ``tune_cpu_allocator()`` (memory/allocator.py) freed buffers above 4 MiB go
back to the system, so RSS follows live memory closely. ``RssAnon`` leaves out the
pages of mapped files (the page cache's, shared with every process that maps them):
``AnonymousPeak`` samples it to see what a step allocates while it reads mapped files.
"""

from __future__ import annotations

import threading


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def current_rss_bytes() -> int:
    """Resident set size now (0 where /proc is not available)."""
    return _status_bytes("VmRSS") or 0


def peak_rss_bytes() -> int:
    """The highest resident set size since start or the last ``reset_peak_rss``."""
    return _status_bytes("VmHWM") or 0


def reset_peak_rss() -> bool:
    """Restart the high-water mark at the current RSS (Linux: clear_refs 5); False when
    the kernel does not allow it, and the mark then keeps counting from the start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def anonymous_rss_bytes() -> int:
    """Resident anonymous memory now (``RssAnon``: not the mapped files' pages)."""
    return _status_bytes("RssAnon") or 0


class AnonymousPeak:
    """``with AnonymousPeak() as peak: ...``: ``peak.rise`` is the highest ``RssAnon``
    seen while the block ran (a thread samples it every ``interval_s``) over its level
    at the start, in bytes. The sampling takes CPU from the block: time it apart."""

    def __init__(self, interval_s: float = 0.001):
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.start = self.peak = 0

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.peak = max(self.peak, anonymous_rss_bytes())

    def __enter__(self) -> "AnonymousPeak":
        self.start = self.peak = anonymous_rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_rss_bytes())

    @property
    def rise(self) -> int:
        return self.peak - self.start
