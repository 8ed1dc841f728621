"""argparse as the ``fullshard`` commands use it."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line (no usage block): the message names the flag."""
        self.exit(2, f"{self.prog}: {message} (see --help)\n")
