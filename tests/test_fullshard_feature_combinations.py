"""Features combined: each row of COMBINATIONS trains a small model whose shapes shard
unevenly, sharded per block, against one process given every rank's batches, and must end
equal to it. Every pair of the features below meets in at least one row, at 2, 3 or 4
ranks:

- reshard after forward (True, False, or to 2 ranks), set_reshard_after_backward(False);
- bf16 mixed precision (fp32 reduce), CPU offload, Shard(1) placement, HSDP;
- accumulation without gradient sync, gradient divide factor, clip_grad_norm_;
- activation checkpointing (the wrapper is the unit), explicit prefetch lists;
- a layer used on some ranks only, a frozen block, a resume through fullshard.checkpoint.

The reference under mixed precision does what fully_shard does: it computes each rank's
micro-batches with a bf16 copy of the fp32 parameters and sums their gradients in fp32.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import Shard

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, checkpoint, fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.parity import full_value

STEPS = 4
FEATURES = ("raf", "keep", "mp", "offload", "shard1", "hsdp", "micro", "divide", "clip", "ac",
            "prefetch", "branch", "freeze", "resume")


def _row(*on: str, opt: str, divide: float, raf: bool | int = False) -> dict:
    """A combination: the features named on, the optimizer, the divide factor (if on)."""
    row = {f: f in on for f in FEATURES}
    row.update(opt=opt, raf=raf if "raf" in on else True, micro=2 if "micro" in on else 1,
               divide=divide if "divide" in on else None)
    return row


# Each row turns on the features it names; together the rows meet every pair of them
# (checked by test_every_pair_of_features_meets_in_a_combination). ``raf`` is
# reshard_after_forward=False; the last row reshards after forward to 2 ranks instead.
COMBINATIONS = {
    2: [
        _row("branch", "clip", "keep", "micro", "offload", "prefetch", "raf", "resume", "shard1",
             opt="adamw", divide=3.0),
        _row("clip", "divide", "freeze", "keep", "micro", "raf", "resume", opt="sgd", divide=3.0),
        _row("divide", "freeze", "keep", "micro", "mp", "raf", "resume", opt="adamw", divide=1.0),
        _row("branch", "micro", "prefetch", "raf", "shard1", opt="sgd", divide=3.0),
    ],
    3: [
        _row("branch", "divide", "freeze", "keep", "micro", "prefetch", opt="adamw", divide=3.0),
        _row("ac", "branch", "clip", "divide", "keep", "prefetch", "shard1", opt="sgd", divide=1.0),
        _row("ac", "freeze", "micro", "raf", "resume", "shard1", opt="adamw", divide=3.0),
        _row("micro", "offload", "shard1", opt="sgd", divide=3.0),
    ],
    4: [
        _row("ac", "branch", "clip", "freeze", "hsdp", "keep", "micro", "mp", "offload",
             "prefetch", "raf", "resume", "shard1", opt="adamw", divide=1.0),
        _row("ac", "branch", "clip", "divide", "freeze", "hsdp", "keep", "micro", "mp", "offload",
             "prefetch", "raf", "resume", "shard1", opt="sgd", divide=3.0),
        _row("ac", "clip", "divide", "hsdp", "micro", "prefetch", "resume", opt="adamw",
             divide=3.0),
        _row("ac", "hsdp", "mp", "prefetch", "raf", "resume", "shard1", opt="sgd", divide=1.0),
        _row("offload", "micro", "freeze", "prefetch", "divide", "keep", "raf", raf=2,
             opt="sgd", divide=3.0),
    ],
}


class _Block(nn.Module):
    def __init__(self, d: int, with_branch: bool):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(d, 2 * d + 1), nn.LayerNorm(2 * d + 1), \
            nn.Linear(2 * d + 1, d)
        self.branch = nn.Linear(d, d, bias=False) if with_branch else None
        self.take_branch = False

    def forward(self, x):
        y = x + self.b(torch.relu(self.norm(self.a(x))))
        return y + self.branch(y) if self.branch is not None and self.take_branch else y


class _Net(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(5, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList(_Block(d, i == 1) for i in range(3))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def take_branch(self, take: bool) -> None:
        for block in self.blocks:
            getattr(block, "_checkpoint_wrapped_module", block).take_branch = take


def _width(c: dict) -> int:
    return 12 if c.get("shard1") else 11  # 12 columns split evenly over 2, 3 and 4 ranks


def _optimizer(c: dict, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if c["opt"] == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _freeze(c: dict, model: _Net) -> None:
    if c.get("freeze"):
        model.blocks[2].requires_grad_(False)


def _sharded(c: dict) -> tuple[_Net, torch.optim.Optimizer]:
    world = dist.get_world_size()
    model = _Net(_width(c))
    _freeze(c, model)
    kw = {}
    if c.get("mp"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if c.get("offload"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if c.get("hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        kw["mesh"] = init_device_mesh("cpu", (2, world // 2),
                                      mesh_dim_names=("replicate", "shard"))
    if c.get("shard1"):
        kw["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 and p.shape[1] == 12 \
            else Shard(0)
    raf = c.get("raf", True)
    for i in range(len(model.blocks)):
        if c.get("ac"):
            model.blocks[i] = checkpoint_wrapper(model.blocks[i])
        fully_shard(model.blocks[i], reshard_after_forward=raf, **kw)
    fully_shard(model, reshard_after_forward=raf, **kw)
    units = [model, *model.blocks]
    if c.get("prefetch"):
        for first, second in zip(model.blocks, list(model.blocks)[1:]):
            first.set_modules_to_forward_prefetch([second])
            second.set_modules_to_backward_prefetch([first])
    for unit in units:
        if c.get("divide"):
            unit.set_gradient_divide_factor(c["divide"])
    return model, _optimizer(c, model)


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(4 + rank, 5, generator=torch.Generator().manual_seed(
        1000 * step + 10 * micro + rank))  # ranks' batches of different sizes


def _takes_branch(c: dict, step: int, rank: int) -> bool:
    return bool(c.get("branch")) and (step + rank) % 2 == 0  # some ranks only


def _train_sharded(c: dict, directory: str) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    model, opt = _sharded(c)
    micro = c.get("micro", 1)
    for step in range(STEPS):
        model.take_branch(_takes_branch(c, step, rank))
        for m in range(micro):
            if micro > 1:
                model.set_requires_gradient_sync(m == micro - 1)
            if c.get("keep"):
                model.set_reshard_after_backward(False)
            model(_batch(step, m, rank)).square().mean().backward()
        if c.get("clip"):
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                           0.5)
        opt.step()
        opt.zero_grad()
        if c.get("resume") and step == STEPS // 2 - 1:
            checkpoint.save(directory, model, opt)
            model, opt = _sharded(c)
            checkpoint.load(directory, model, opt)
    # parameters kept gathered across the last backward: the module shows the shards
    return {name.replace("_checkpoint_wrapped_module.", ""): full_value(p.detach()).float()
            for name, p in model.named_parameters()}


def _one_process(c: dict, world: int) -> dict[str, torch.Tensor]:
    """Every rank's micro-batches in one process; under mixed precision each rank's
    gradients come from a bf16 copy of the parameters and are summed in fp32."""
    model = _Net(_width(c))
    _freeze(c, model)
    opt = _optimizer(c, model)
    scale = world / c["divide"] if c.get("divide") else 1.0  # sum / divide, not mean
    for step in range(STEPS):
        total: dict[str, torch.Tensor] = {}
        for rank in range(world):
            computes = copy.deepcopy(model).to(torch.bfloat16) if c.get("mp") else model
            computes.take_branch(_takes_branch(c, step, rank))
            for m in range(c.get("micro", 1)):
                x = _batch(step, m, rank)
                computes(x.to(torch.bfloat16) if c.get("mp") else x).square().mean().backward()
                for name, p in computes.named_parameters():
                    if p.grad is not None:
                        total[name] = total.get(name, 0) + p.grad.float()
                        p.grad = None
        for name, p in model.named_parameters():
            p.grad = total[name] * scale / world if name in total else None
        if c.get("clip"):
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                           0.5)
        opt.step()
        opt.zero_grad()
    return {name: p.detach().float() for name, p in model.named_parameters()}


def _combinations(directory: str) -> list[dict]:
    world = dist.get_world_size()
    out = []
    for i, c in enumerate(COMBINATIONS[world]):
        path = os.path.join(directory, f"world{world}_{i}")
        sharded, reference = _train_sharded(c, path), _one_process(c, world)
        out.append({name: ((sharded[name] - ref).abs().max() / ref.abs().max()).item()
                    for name, ref in reference.items()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(COMBINATIONS))
def test_features_combined_train_as_one_process(world, tmp_path):
    for c, diffs in zip(COMBINATIONS[world], run_distributed(_combinations, world,
                                                             str(tmp_path))[0]):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= 1e-5, (c, worst, diffs[worst])


def test_every_pair_of_features_meets_in_a_combination():
    rows = [row for rows in COMBINATIONS.values() for row in rows]

    def on(row, feature):
        if feature == "raf":
            return row["raf"] is not True
        return row["micro"] > 1 if feature == "micro" else bool(row[feature])

    apart = [(a, b) for i, a in enumerate(FEATURES) for b in FEATURES[i + 1:]
             if not any(on(row, a) and on(row, b) for row in rows)]
    assert not apart, apart
