"""Collectives that carry int8 with blockwise scales (ZeRO++'s qwZ and qgZ).

Note [quantized communication]
``set_quantized_communication(weights=, grads=)`` trades exactness on the wire for
bytes, as DeepSpeed's ZeRO++ does, for links where bandwidth, not compute, bounds the
step (gradients and weights crossing nodes over Ethernet or a slow InfiniBand).

Blockwise int8: a flat tensor is cut into blocks of ``block_size`` elements (the last one
padded with zeros); each block is sent as int8 ``round(x / s)`` with its own fp32 scale
``s = absmax / 127``, so one outlier spoils only its block. Bytes per element: 1 +
4 / block_size (1.016 at the default 256) against 2 for bf16 and 4 for fp32.

Weights (qwZ): each rank quantizes its shard of the gathered parameters (in the compute
dtype), the int8 blocks and scales of every rank are all-gathered as bytes in one
collective, and each rank dequantizes every shard into the unsharded buffer. The sharded
parameters, the optimizer and the checkpoints keep full precision: only the copy the
forward and backward compute with is rounded, and it is gathered again each time.

Gradients (qgZ): a reduce-scatter whose sum is taken in fp32 after the wire. Each rank
quantizes each destination's chunk of its gradients, one all-to-all delivers chunk j of
every rank to rank j, which dequantizes the world-size copies and sums them in fp32 into
its sharded gradient (ZeRO++ does the same in two hops, within then across nodes; this
is its one-hop form). The last ``exact_tail`` elements of every chunk travel unquantized
in fp32: they are the presence flags (Note [gradient presence flags]), which must sum
exactly.

Both are issued asynchronously; the dequantization runs when the collective is waited on
(``Pending.finish``), where the built-in path would copy out or sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..comm import Pending, _done

DEFAULT_BLOCK_SIZE = 256
_LEVELS = 127.0


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def wire_bytes(numel: int, block: int) -> int:
    """Bytes one rank sends for ``numel`` quantized elements (int8 plus fp32 scales)."""
    nb = _blocks(numel, block)
    return nb * block + 4 * nb


def quantize(rows: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """Quantize each row of ``rows`` (2-D float, any width) blockwise into ``out`` (uint8,
    one row of ``wire_bytes(width, block)`` per row: the int8 blocks, then the scales)."""
    n_rows, width = rows.shape
    nb = _blocks(width, block)
    x = rows.float()
    if nb * block != width:
        x = torch.nn.functional.pad(x, (0, nb * block - width))
    x = x.view(n_rows, nb, block)
    scale = x.abs().amax(dim=2, keepdim=True).div_(_LEVELS)
    scale.masked_fill_(scale == 0, 1.0)  # an all-zero block: any scale gives zeros
    q = x.div(scale).round_().clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    out[:, :nb * block].view(torch.int8).copy_(q.view(n_rows, -1))
    out[:, nb * block:].view(torch.float32).copy_(scale.view(n_rows, nb))


def dequantize(packed: torch.Tensor, width: int, block: int) -> torch.Tensor:
    """The fp32 ``[rows, width]`` values of ``packed`` (rows as ``quantize`` writes them)."""
    n_rows = packed.shape[0]
    nb = _blocks(width, block)
    q = packed[:, :nb * block].view(torch.int8).view(n_rows, nb, block)
    scale = packed[:, nb * block:].view(torch.float32).view(n_rows, nb, 1)
    return (q.float() * scale).view(n_rows, nb * block)[:, :width]


# Rows dequantized per pass: the fp32 temporary is this many rows, not the world's.
ROWS_PER_PASS = 8


def _dequantize_rows(packed: torch.Tensor, width: int, block: int):
    """``(first_row, fp32 values)`` for passes of at most ROWS_PER_PASS rows."""
    for first in range(0, packed.shape[0], ROWS_PER_PASS):
        yield first, dequantize(packed[first:first + ROWS_PER_PASS], width, block)


def quantized_all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
                         block: int, async_op: bool = False,
                         what: str = "an all-gather", patience=None) -> Pending:
    """``all_gather`` of int8 blocks: every rank's ``shard`` lands, dequantized, in its
    rank-major slot of ``output`` (Note [quantized communication])."""
    w, n = group.size(), shard.numel()
    per_rank = wire_bytes(n, block)
    send = torch.empty(1, per_rank, dtype=torch.uint8, device=shard.device)
    quantize(shard.view(1, n), block, send)
    received = torch.empty(w * per_rank, dtype=torch.uint8, device=shard.device)
    comm.issued("all_gather", group, async_op)
    work = comm._all_gather_flat(received, send.view(-1), group=group, async_op=True)

    def unpack() -> None:
        rows = output.view(w, n)
        for first, values in _dequantize_rows(received.view(w, per_rank), n, block):
            rows[first:first + values.shape[0]].copy_(values)

    return _done(Pending(output, work, unpack), async_op, what, patience)


def quantized_reduce_scatter_sum(output: torch.Tensor, full: torch.Tensor,
                                 group: dist.ProcessGroup, block: int, exact_tail: int = 0,
                                 async_op: bool = False,
                                 what: str = "a reduce-scatter") -> Pending:
    """``reduce_scatter_sum`` with int8 blocks on the wire and the sum in fp32; the last
    ``exact_tail`` elements of each chunk are sent in fp32 (Note [quantized
    communication])."""
    w = group.size()
    chunks = full.view(w, -1)
    numel = chunks.shape[1]
    body = numel - exact_tail
    q_bytes = wire_bytes(body, block)
    per_rank = q_bytes + 4 * exact_tail
    send = torch.empty(w, per_rank, dtype=torch.uint8, device=full.device)
    quantize(chunks[:, :body], block, send[:, :q_bytes])
    if exact_tail:
        send[:, q_bytes:].view(torch.float32).copy_(chunks[:, body:])
    received = torch.empty_like(send)
    comm.issued("reduce_scatter", group, async_op)
    work = dist.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=True)

    def sum_copies() -> None:
        total = torch.zeros(body, dtype=torch.float32, device=output.device)
        for _, values in _dequantize_rows(received[:, :q_bytes], body, block):
            total += values.sum(dim=0)
        output[:body].copy_(total)
        if exact_tail:
            output[body:].copy_(received[:, q_bytes:].view(torch.float32).sum(dim=0))

    return _done(Pending(output, work, sum_copies), async_op, what)
