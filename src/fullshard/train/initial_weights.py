"""Rank 0's initial weights, sent to the other ranks after sharding.

Only rank 0 builds (or loads) the full model on the CPU; the others build it on the
meta device, so a node needs host memory for one full copy instead of one per rank.
After ``fully_shard`` every rank receives its shards of rank 0's state dict, one tensor
at a time, and then the buffers a state dict leaves out (non-persistent ones such as
rotary-embedding frequencies), which the other ranks still hold on the meta device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..checkpoint import StateDictOptions, set_model_state_dict


def receive_initial_weights(model: nn.Module, rank0_state: dict, device: torch.device) -> None:
    """Load rank 0's full ``rank0_state`` (empty on other ranks) into the sharded ``model``."""
    set_model_state_dict(model, rank0_state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    _broadcast_left_out_buffers(model, set(rank0_state) if dist.get_rank() == 0 else None,
                                device)


def _broadcast_left_out_buffers(model: nn.Module, saved: set[str] | None,
                                device: torch.device) -> None:
    """Send every buffer missing from rank 0's state dict, in ``named_buffers`` order (the
    same on every rank: the same architecture)."""
    names = [saved] if saved is not None else [None]
    dist.broadcast_object_list(names, src=0)  # which buffers the state dict carried
    carried = names[0]
    with torch.no_grad():
        for name, buf in list(model.named_buffers()):
            if name in carried:
                continue
            owner_path, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_path)
            if buf.is_meta:
                buf = torch.empty_like(buf, device=device)
                owner._buffers[attr] = buf
            dist.broadcast(buf, src=0)
