"""The fp16 loss scaler of the trainer: an overflow on one rank skips the step on every
rank and lowers every rank's scale alike."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fullshard.testing import run_distributed
from fullshard.train.scaler import AgreedGradScaler, agree_found_inf, _steps_on_host_of_a_gpu_scale


def _one_rank_overflows() -> dict:
    """Rank 1 alone finds an inf in its gradient; each optimizer (plain and fused) steps
    through the scaler as the trainer drives it: unscale_, step, update."""
    out = {}
    for name, make in {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
                       "fused_adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True)}.items():
        p = torch.nn.Parameter(torch.ones(4))
        optimizer = make([p])
        scaler = AgreedGradScaler("cpu", init_scale=2.0 ** 16)
        scaler.scale((p * torch.arange(4.0)).sum()).backward()
        if dist.get_rank() == 1:
            p.grad[0] = float("inf")
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        out[name] = (p.detach().tolist(), scaler.get_scale())
    return out


@pytest.mark.slow
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    results = run_distributed(_one_rank_overflows, 2)
    for name in ("sgd", "fused_adamw"):
        (weights0, scale0), (weights1, scale1) = results[0][name], results[1][name]
        assert weights0 == weights1 == [1.0] * 4, name  # skipped everywhere
        assert scale0 == scale1 == 2.0 ** 15, name      # backed off everywhere


def test_the_agreed_flag_counts_once_however_many_devices_hold_gradients():
    """Outside a process group: the flags of two devices (the first a 0, the second a
    1) become one 1 and one 0, so their sum, which a fused optimizer subtracts from its
    step counts, stays 1; a rank with no flag gets one."""
    first, second = torch.zeros(()), torch.ones(())
    per_device = agree_found_inf({"a": first, "b": second}, torch.device("cpu"), None)
    assert [v.item() for v in per_device.values()] == [1.0, 0.0]
    empty = agree_found_inf({}, torch.device("cpu"), None)
    assert [v.item() for v in empty.values()] == [0.0]


def test_a_fused_optimizer_on_the_host_reads_a_gpu_flag_only_through_the_host():
    """Fused AdamW over host parameters with the scale on a GPU takes the path that reads
    the flag on the host; with the scale on the host, or a plain optimizer, torch's."""
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], fused=True)
    plain = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert _steps_on_host_of_a_gpu_scale(fused, "cuda")
    assert not _steps_on_host_of_a_gpu_scale(fused, "cpu")
    assert not _steps_on_host_of_a_gpu_scale(plain, "cuda")
