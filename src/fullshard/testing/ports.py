"""A free TCP port on the loopback address, for launchers and rendezvous started by
tests and benchmarks (the harness itself meets through a file, needing none)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nobody listens on now (the kernel's pick for a socket bound to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
