"""argparse as the ``fullshard`` commands use it."""

from __future__ import annotations

import argparse

from ..errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line (no usage block) that starts with the flag, as config errors do:
        ``fullshard estimate: --world-size: must be in [1, 65536], got 0 (see --help)``."""
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')} (see --help)\n")


def check_seq(seq: int, positions: int, preset: str) -> None:
    """``--seq`` within the learned positions of a preset's GPT (its trainer refuses more)."""
    if seq > positions:
        raise ConfigError(f"--seq: {seq} exceeds the {positions} positions of the {preset} "
                          f"preset's model; give --seq {positions} or less")
