"""What the operating system says about this process's memory (Linux ``/proc``).

On CPU the figure that matters is resident memory: ``VmRSS`` now and ``VmHWM``
(its high-water mark) since the process started or since ``reset_peak_rss``.
With ``tune_cpu_allocator()`` (memory/allocator.py) freed buffers above 4 MiB go
back to the system, so RSS follows live memory closely.
"""

from __future__ import annotations


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
