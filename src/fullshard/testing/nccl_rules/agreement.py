"""Ranks compare the signatures of the collective they are about to issue.

Before each checked collective every rank of its group all-gathers two int64s on the
same group: the group's running collective number on this rank and a hash of the
signature (signature.py). Those few bytes are alike in size on every rank, so the
exchange itself always completes, and it sits in each rank's sequence at the place of
the collective it checks, so the program's order is unchanged. When the rows differ
every rank sees it at once; a second exchange of the signatures' text (fixed size
again) lets every rank raise the same error naming what each rank issued.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

from .errors import NcclRuleError

TEXT_BYTES = 512  # a signature's text is cut to this many bytes in the error


def agree(all_gather: Callable, group, number: int, signature: str, where: str,
          ranks: list[int]) -> None:
    """Raise ``NcclRuleError`` on every rank of ``group`` unless all of them issue
    ``signature`` as the group's collective ``number``; ``where`` names the group and
    ``ranks`` are its members' global ranks, in group order.

    ``all_gather(group, output, input)`` is the unchecked flat all-gather."""
    mine = torch.tensor([number, _hash(signature)], dtype=torch.int64)
    rows = torch.empty(group.size() * 2, dtype=torch.int64)  # gloo wants it flat
    all_gather(group, rows, mine).wait()
    rows = rows.view(-1, 2)
    if bool((rows == mine).all()):
        return
    texts = _gather_texts(all_gather, group, signature)
    numbers = rows[:, 0].tolist()
    raise NcclRuleError(mismatch_message(where, number, numbers, texts, ranks))


def mismatch_message(where: str, number: int, numbers: list[int], texts: list[str],
                     ranks: list[int]) -> str:
    """The error every rank raises: ranks that issued alike are named together."""
    by_text: dict[tuple[int, str], list[int]] = {}
    for rank, n, text in zip(ranks, numbers, texts):
        by_text.setdefault((n, text), []).append(rank)
    issued = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))} issued "
                       f"#{n} {text}" for (n, text), r in by_text.items())
    return (f"NCCL rule broken at collective #{number} on {where}: ranks issued different "
            f"collectives ({issued}); on NCCL this hangs, crashes or silently mixes tensors")


def _gather_texts(all_gather: Callable, group, signature: str) -> list[str]:
    raw = signature.encode()[:TEXT_BYTES].ljust(TEXT_BYTES, b"\0")
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    rows = torch.empty(group.size() * TEXT_BYTES, dtype=torch.uint8)
    all_gather(group, rows, mine).wait()
    return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")
            for row in rows.view(-1, TEXT_BYTES)]


def _hash(signature: str) -> int:
    # Python's hash() of a str differs by process (PYTHONHASHSEED); blake2b does not.
    return int.from_bytes(hashlib.blake2b(signature.encode(), digest_size=8).digest(),
                          "little", signed=True)
