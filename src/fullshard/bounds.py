"""The bounds of every number a fullshard command reads, and the one check they all use.

Each number is declared once with its :class:`Bounds`: a config field in its dataclass
field's metadata (:func:`within`), a flag of ``estimate``, ``plan`` or the launcher as its
argparse ``type`` (:func:`flag_type`). Every value is checked by :meth:`Bounds.check`,
which also refuses NaN and infinities, so a bad number is one line naming the field or
flag and the range it accepts, wherever it came from (a flag, a TOML file, Python).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable

from .errors import ConfigError


@dataclass(frozen=True)
class Bounds:
    """Accepted values: finite, at least ``low``, at most ``high`` (below it if
    ``high_open``); None leaves that side open."""

    low: float | None = None
    high: float | None = None
    high_open: bool = False

    def describe(self) -> str:
        if self.high is None:
            return "any number" if self.low is None else f">= {self.low}"
        low = "-inf" if self.low is None else self.low
        return f"in [{low}, {self.high}{')' if self.high_open else ']'}"

    def problem(self, value: float) -> str | None:
        """Why ``value`` is refused ("must be ..., got ..."), or None if it is accepted."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number {self.describe()}, got {value}"
        above = self.high is not None and (value >= self.high if self.high_open
                                           else value > self.high)
        if (self.low is not None and value < self.low) or above:
            return f"must be {self.describe()}, got {value}"
        return None

    def check(self, name: str, value: float) -> None:
        """Raise ConfigError "NAME: must be ..., got VALUE" unless ``value`` is accepted."""
        problem = self.problem(value)
        if problem is not None:
            raise ConfigError(f"{name}: {problem}")


def within(low: float | None, high: float | None = None, *, high_open: bool = False) -> dict:
    """Dataclass field metadata declaring the field's bounds (checked by config.validate)."""
    return {"bounds": Bounds(low, high, high_open)}


def flag_type(kind: type, bounds: Bounds) -> Callable[[str], float]:
    """An argparse ``type=``: the flag's text as ``kind`` (int or float) within ``bounds``;
    argparse prefixes the message with the flag's name."""
    words = {int: "an int", float: "a number"}[kind]

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {words} {bounds.describe()}, got {text!r}") from None
        problem = bounds.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse
