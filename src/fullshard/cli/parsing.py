"""argparse as the ``fullshard`` commands use it."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line (no usage block) that starts with the flag, as config errors do:
        ``fullshard estimate: --world-size: must be in [1, 65536], got 0 (see --help)``."""
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')} (see --help)\n")
