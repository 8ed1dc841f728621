"""Multi-process test harness and parity helpers (gloo on CPU)."""

from .harness import run_distributed

__all__ = ["run_distributed"]
