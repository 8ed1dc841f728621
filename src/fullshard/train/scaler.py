"""The fp16 loss scaler of a sharded model: one decision for every rank.

torch's ``GradScaler`` checks the gradients it unscales for infs and NaNs, and skips the
step and lowers the scale when it finds one. On a sharded model each rank unscales only
its own shards, so an overflow in one rank's rows is seen by that rank alone: it skips
while the others step, and the ranks' scales part ways for good, silently. Here the
found-inf flags are combined over the ranks (a MAX all-reduce) as soon as they are
computed, before ``step`` or ``update`` reads them, as torch's ``ShardedGradScaler``
does for FSDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class AgreedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose found-inf flags are the same on every rank of
    ``group`` (None: the default group; it must hold every rank that shards or
    replicates a parameter of the optimizers it steps). One all-reduce of one number
    per optimizer and step."""

    def __init__(self, device: str = "cuda", group: dist.ProcessGroup | None = None,
                 **kwargs):
        super().__init__(device, **kwargs)
        self.group = group

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # Both unscale_ and the fused-optimizer path of step (_check_inf_per_device) come
        # through here: whichever runs, the flags it returns are already common.
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return agree_found_inf(per_device, found_inf.device, self.group)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """``GradScaler.step``; an optimizer that supports AMP scaling but steps on the host
        (fused AdamW over offloaded parameters) while the scale lives on a GPU steps as
        any other: skipped, or not, by the flag read on the host."""
        if not (self._enabled and _steps_on_host_of_a_gpu_scale(optimizer, self._device)):
            return super().step(optimizer, *args, **kwargs)
        # torch hands such an optimizer the GPU flag, which it copies to the host without
        # blocking and reads at once, before the copy has landed. Hidden on the instance,
        # the attribute sends step through its other path, which reads the flag itself
        # (fused AdamW sets it on the instance: it is put back, not deleted).
        optimizer._step_supports_amp_scaling = False
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            optimizer._step_supports_amp_scaling = True


def agree_found_inf(per_device: dict, device: torch.device,
                    group: dist.ProcessGroup | None) -> dict:
    """The flags of ``per_device`` ({device: 0-dim float tensor, 1.0 where an inf or NaN
    was found}) made common over ``group``: the first flag holds the largest over every
    device and rank, the others 0. Their sum, which ``step`` and ``update`` read (and a
    fused optimizer subtracts from its step counts), stays 0 or 1. A rank without
    gradients adds a flag on ``device`` so that it joins the all-reduce and the update."""
    flags = list(per_device.values())
    local = (torch.stack([f.reshape(()).to(device) for f in flags]).amax() if flags
             else torch.zeros((), dtype=torch.float32, device=device))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    if not flags:
        return {device: local}
    for i, flag in enumerate(flags):
        if i == 0:
            flag.copy_(local)  # to a host flag: blocking, so the host reads the result
        else:
            flag.zero_()
    return per_device


def _steps_on_host_of_a_gpu_scale(optimizer: torch.optim.Optimizer, scale_device: str) -> bool:
    return (scale_device != "cpu" and getattr(optimizer, "_step_supports_amp_scaling", False)
            and steps_on_host(optimizer))


def steps_on_host(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps parameters that live on the host (offloaded)."""
    return any(p.device.type == "cpu" for group in optimizer.param_groups
               for p in group["params"])
