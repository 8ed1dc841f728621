"""The error every bad command-line value, config field or file argument raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that is not accepted; the message is one line."""
