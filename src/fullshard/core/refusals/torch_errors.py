"""Errors raised where torch's FSDP2 raises for the same misuse.

Code written for torch's ``fully_shard`` (its own tests among it) catches torch's
exception type and matches torch's message, so fullshard raises that type with torch's
message first and its own guidance after it. Where torch raises ``AssertionError`` for
bad input, fullshard's exception is also a ``ValueError``, which is what bad input
raises everywhere else in fullshard.
"""

from __future__ import annotations


class FullyShardArgumentError(AssertionError, ValueError):
    """Bad input that torch's FSDP2 refuses with ``AssertionError``."""


class UnsupportedCopyError(AssertionError, TypeError):
    """``copy.deepcopy`` or pickling of a sharded module: torch's FSDP2 raises
    ``AssertionError``; fullshard raised ``TypeError`` first, and keeps it as a base so
    code written against either catches it."""


def torch_first(torch_message: str, guidance: str) -> str:
    """torch's message, then fullshard's: one line a regex written for torch matches."""
    return f"{torch_message} {guidance}"
