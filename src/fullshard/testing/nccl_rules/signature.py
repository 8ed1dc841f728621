"""What NCCL needs every rank to agree on for one collective, as one line of text.

NCCL matches collectives by their place in each communicator's sequence, never by
what they carry: a rank that issues 10 floats where its peer issues 20 hangs or reads
past a buffer, and two same-sized all-reduces swapped on one rank sum each other's
tensors without a word. The line written here names the operation and what must match
across ranks (dtypes, shapes, reduce op, root); what may differ legitimately (the
received chunk of an uneven reduce-scatter, an all-to-all's split sizes, the lists only
the root of a gather or scatter fills) is left out.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterator

import torch


def describe(op: str, args: tuple, kwargs: dict) -> str:
    """``op(dtype[shape], ..., op=SUM, root=0)``: the signature of one call of ``op``."""
    parts = _PARTS.get(op, _all_of)(args, kwargs)
    return f"{op}({', '.join(p for p in parts if p)})"


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``: a tensor or lists and tuples of them, nested."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)


def _tensor(t: torch.Tensor, skip_dim0: bool = False) -> str:
    dims = ["*", *map(str, t.shape[1:])] if skip_dim0 and t.dim() else map(str, t.shape)
    return f"{str(t.dtype).removeprefix('torch.')}[{','.join(dims)}]"


def _reduce_op(op: Any) -> str:
    # ReduceOp wraps a RedOpType (op.op) whose str is "RedOpType.SUM".
    return "op=" + str(getattr(op, "op", op)).rsplit(".", 1)[-1]


def _part(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_part(v) for v in value) + "]"
    if isinstance(value, (torch.distributed.ReduceOp, torch.distributed.ReduceOp.RedOpType)):
        return _reduce_op(value)
    if value is None or isinstance(value, (datetime.timedelta, str)):
        return ""  # timeouts and tags are per-rank choices NCCL never compares
    if isinstance(value, int):
        return str(value)  # a root given positionally (broadcast's second overload)
    return _options(value)


def _options(opts: Any) -> str:
    # The *Options objects carry the reduce op and the root; timeouts stay local.
    fields = []
    if hasattr(opts, "reduceOp"):
        fields.append(_reduce_op(opts.reduceOp))
    if hasattr(opts, "rootRank"):
        fields.append(f"root={opts.rootRank}")
    return ", ".join(fields)


def _all_of(args: tuple, kwargs: dict) -> list[str]:
    return [_part(a) for a in (*args, *kwargs.values())]


def _all_to_all_single(args: tuple, kwargs: dict) -> list[str]:
    # (output, input, output_split_sizes, input_split_sizes, ...): with splits each rank
    # sends and receives its own row counts, so only dtype and trailing dims must match.
    output, input_, out_splits, in_splits = args[:4]
    uneven = bool(out_splits) or bool(in_splits)
    return [_tensor(output, uneven), _tensor(input_, uneven)]


def _all_to_all(args: tuple, kwargs: dict) -> list[str]:
    outputs, inputs = args[:2]
    return ["[" + ", ".join(_tensor(t, True) for t in (*outputs, *inputs)) + "]"]


def _all_gather(args: tuple, kwargs: dict) -> list[str]:
    # The output lists are alike on every rank; the input is this rank's own entry.
    return [_part(args[0])]


def _rooted(side: int) -> Callable[[tuple, dict], list[str]]:
    # gather(outputs, inputs, opts) / scatter(outputs, inputs, opts): only the root fills
    # the list side; the other side is alike on every rank.
    def parts(args: tuple, kwargs: dict) -> list[str]:
        return [_part(args[side]), *(_part(a) for a in args[2:]), *map(_part, kwargs.values())]
    return parts


def _reduce_scatter(args: tuple, kwargs: dict) -> list[str]:
    # (outputs, input_lists, opts): an uneven reduce-scatter's outputs differ by rank.
    return [_part(a) for a in (*args[1:], *kwargs.values())]


_PARTS: dict[str, Callable[[tuple, dict], list[str]]] = {
    "all_to_all_single": _all_to_all_single,
    "alltoall_base": _all_to_all_single,
    "alltoall": _all_to_all,
    "allgather": _all_gather,
    "gather": _rooted(1),
    "scatter": _rooted(0),
    "reduce_scatter": _reduce_scatter,
}


def describe_functional(op: str, tensor: torch.Tensor, extra: tuple, uneven: bool = False) -> str:
    """The signature of a functional collective (``torch.distributed._functional_collectives``):
    its input, then its reduce op (a string there) and dims."""
    parts = [_tensor(tensor, uneven)]
    parts += [f"op={a.upper()}" if isinstance(a, str) else str(a) for a in extra]
    return f"{op}({', '.join(parts)})"
