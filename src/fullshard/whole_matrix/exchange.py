"""The collectives of a whole-matrix step (Note [whole-matrix optimizers]): where each
parameter's rows live, one all-to-all of flat pieces per shard group, and the small
agreement on what has to travel."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..core.comm import note_collective
from ..core.param import ShardLayout


class Item(NamedTuple):
    """One sharded parameter of the optimizer and the rank that steps it whole."""
    param: DTensor
    sp: object               # its ShardedParam
    pg: dist.ProcessGroup    # its shard group
    owner: int               # the rank (within ``pg``) that steps it whole


def shard_group(p: DTensor) -> dist.ProcessGroup:
    dim = next(i for i, pl in enumerate(p.placements) if isinstance(pl, Shard))
    return p.device_mesh.get_group(dim)


def _layout(item: Item, rank: int) -> ShardLayout:
    return ShardLayout.of(item.sp.layout.shape, rank, item.sp.world_size, item.sp.layout.dim)


def rows(item: Item, rank: int) -> tuple[int, int]:
    """(first index, count) along the sharded dim of the parameter's piece on ``rank`` of
    its shard group: rows on dim 0, columns on dim 1 (``shard_placement_fn``)."""
    lay = _layout(item, rank)
    return min(rank * lay.rows_per_rank, lay.shape[lay.dim]), lay.valid_rows


def numel(item: Item, rank: int) -> int:
    """Elements of the parameter's piece on ``rank``."""
    return rows(item, rank)[1] * _layout(item, rank).row_numel


def piece(item: Item, whole: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of a whole tensor shaped like the parameter (a view)."""
    first, count = rows(item, rank)
    return whole.narrow(item.sp.layout.dim, first, count)


def join(item: Item, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor from every rank's piece, flat, in rank order."""
    shaped = [t.view(_layout(item, r).padded_shape(rows(item, r)[1]))
              for r, t in enumerate(pieces)]
    return torch.cat(shaped, dim=item.sp.layout.dim)


def by_group(items: list[Item]) -> list[list[Item]]:
    """The items split by shard group, each list in the items' order."""
    groups: dict[int, list[Item]] = {}
    for item in items:
        groups.setdefault(id(item.pg), []).append(item)
    return list(groups.values())


def comm_device(pg: dist.ProcessGroup, ref: torch.Tensor) -> torch.device:
    """Where the collectives run: the mesh's device (an offloaded shard is copied there)."""
    backend = str(dist.get_backend(pg))
    if "nccl" in backend and ref.device.type == "cpu":
        return torch.device("cuda", torch.cuda.current_device())
    return ref.device


class OnDevice(NamedTuple):
    """A tensor that lived on a device, carried on the host through an object collective."""
    host: torch.Tensor


def host_values(values: dict) -> dict:
    """``values`` ready for an object collective: each tensor on a device copied to the
    host (marked ``OnDevice``). Pickled as it is, a CUDA tensor names its device and
    unpickles onto the sender's ``cuda:k`` on every receiver: another rank's GPU, or
    "Attempting to deserialize object on CUDA device k" where each process sees one."""
    return {k: OnDevice(v.to("cpu")) if isinstance(v, torch.Tensor) and v.device.type != "cpu"
            else v for k, v in values.items()}


def device_values(values: dict, device: torch.device) -> dict:
    """The inverse of :func:`host_values` on the receiving rank: what lived on a device
    goes to ``device`` (this rank's, beside its parameter), host tensors stay."""
    return {k: v.host.to(device) if isinstance(v, OnDevice) else v for k, v in values.items()}


class InFlight:
    """An all-to-all issued and not yet waited on; its send buffer lives until then."""

    def __init__(self, work, send: torch.Tensor, received: torch.Tensor,
                 receive_numel: list[int]):
        self.work = work     # the collective's Work (None on a group of one rank)
        self.send: torch.Tensor | None = send
        self.received = received
        self.receive_numel = receive_numel

    def wait(self) -> list[torch.Tensor]:
        """Wait (once) and free the send buffer; returns what each rank sent here, flat."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            note_collective()
        self.send = None
        return list(torch.split(self.received, self.receive_numel))


def start_all_to_all(pg: dist.ProcessGroup, sends: list[list[torch.Tensor]],
                     receive_numel: list[int], dtype: torch.dtype,
                     device: torch.device) -> InFlight:
    """Issue an all-to-all of ``sends[r]`` (flattened, concatenated) to each rank r; what
    each rank sent here comes from its ``wait``."""
    send_numel = [sum(t.numel() for t in pieces) for pieces in sends]
    send = torch.empty(sum(send_numel), dtype=dtype, device=device)
    offset = 0
    for t in (t for pieces in sends for t in pieces):  # one copy in, no intermediate cat
        send[offset:offset + t.numel()].view_as(t).copy_(t)
        offset += t.numel()
    received = torch.empty(sum(receive_numel), dtype=dtype, device=device)
    work = None
    if pg.size() == 1:
        received.copy_(send)
    else:
        work = dist.all_to_all_single(received, send, receive_numel, send_numel, group=pg,
                                      async_op=True)
        note_collective()  # Note [collectives settle before exit]
    return InFlight(work, send, received, receive_numel)


def all_to_all(pg: dist.ProcessGroup, sends: list[list[torch.Tensor]], receive_numel: list[int],
               dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """All-to-all of ``sends[r]`` (flattened, concatenated) to each rank r; returns what each
    rank sent here, flat, on ``device``."""
    return start_all_to_all(pg, sends, receive_numel, dtype, device).wait()


def agree(pg: dist.ProcessGroup, local: list[list[int]], device: torch.device,
          changed: list[torch.Tensor | None] | None = None) -> list[tuple]:
    """Each rank's small integers per item (a row of ``local`` each), reduced over the shard
    group to (the largest, the smallest) of each: one all-reduce of a few bytes per item,
    so that every rank decides alike what the step's all-to-alls carry. ``changed``: per
    item, None or a 0-dim bool tensor (``differs``), still on its device, that is or-ed
    into the item's first integer. The step's one host synchronization per shard group
    is the read of the result: the flags are not read one by one."""
    if not local:
        return []
    mine = _moved(torch.tensor(local, dtype=torch.int64), device)
    if changed is not None and any(c is not None for c in changed):
        where = next(c for c in changed if c is not None).device
        none = torch.zeros((), dtype=torch.bool, device=where)
        column = _moved(torch.stack([none if c is None else c for c in changed]), device)
        mine[:, 0] = torch.maximum(mine[:, 0], column.to(torch.int64))
    both = torch.cat([mine, -mine], dim=1)
    if pg.size() > 1:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=pg)
        note_collective()
    width = mine.shape[1]
    return [(tuple(row[:width]), tuple(-v for v in row[width:])) for row in both.tolist()]


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from the host through pinned memory: a copy from pageable
    memory would make the host wait for everything queued on the stream."""
    if t.device == device:
        return t
    return t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu" else t.to(device)


def differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether two tensors of one shape and dtype hold different bits, as a 0-dim bool
    tensor where they live, so that many are read at once (``torch.equal`` reads each on
    the host). Bits, not values: -0.0 and 0.0 differ and a NaN is itself, as a
    whole-matrix step must see exactly the values its shards hold."""
    if a.dtype.is_floating_point:
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(bits), b.view(bits)
    return (a != b).any()
