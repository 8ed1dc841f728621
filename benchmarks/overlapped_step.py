"""The CPU-offloaded step overlapped with the next forward (fullshard.OverlappedStep) against
stepping first (optimizer.step()), and torch FSDP2's CPUOffloadPolicy for scale.

    OMP_NUM_THREADS=1 python benchmarks/overlapped_step.py [--rounds 4] [--block 5] [--shape w1|step-bound|tiny] [--no-clip] [--host-threads 1]

One rank (gloo), W1's shape (GPT d=512, 8 layers, vocab 8192, batch 8 x 128), fused AdamW,
clip to norm 1 as fullshard's trainer clips (the norm from the gradients' device-side
norms, the coefficient applied inside the fused step). Three copies of the model train
in one process, a block of steps each in turn, the order turned each round so the
machine's drift hits each alike (steps interleaved one by one would hide one copy's host
step behind another's forward):
fullshard stepping first, fullshard with OverlappedStep, and FSDP2 (torch's
clip_grad_norm_, fused AdamW). Prints the median step time of each (the time from one
step's forward to the next's, which includes the host step either way), the ratios, and
the largest loss difference between the two fullshard copies (0: the same bits).
With ``--no-clip`` nothing is clipped and a fourth copy steps each offloaded unit during
backward (``OverlappedStep.stepping_in_backward()``). A further copy runs
``OverlappedStep(delayed=True)`` (ZeRO-Offload's delayed update: its next forward waits
for no host step, on one-step-stale parameters, so its losses differ from the others' by
design; the largest difference is printed, not checked). ``--host-threads N`` gives the
host-step thread N intra-op threads (``torch.set_num_threads`` called on that thread:
OpenMP's thread count is a per-thread setting) while the main thread keeps
OMP_NUM_THREADS.

On a CPU the "device" is the CPU too: the overlap can only use a core the forward leaves
idle (one rank, the host thread beside the main one), which is what this measures; on a
GPU the forward runs on the device and the whole host step can hide behind it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fullshard import CPUOffloadPolicy, OverlappedStep, fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.grad_norm import clip_coefficient, grad_norm
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch

W1 = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8)
# many parameters for the tokens: a host step as long as the forward (what a GPU's
# offloaded step looks like, where the device computes fast and the host steps slowly)
STEP_BOUND = GPTConfig(vocab_size=16384, seq_len=64, d_model=1024, n_layers=6, n_heads=8)
TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=3, n_heads=2)
SHAPES = {"w1": (W1, 8), "step-bound": (STEP_BOUND, 2), "tiny": (TINY, 2)}


class Copy:
    """One model, its optimizer and how it steps."""

    def __init__(self, cfg: GPTConfig, how: str, clip: bool, host_threads: int):
        torch.manual_seed(0)
        self.model = GPT(cfg)
        self.how = how
        if how == "fsdp2":
            for layer in self.model.layers:
                torch_fully_shard(layer, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
            torch_fully_shard(self.model, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
        else:
            policy = CPUOffloadPolicy(pin_memory=False)
            for layer in self.model.layers:
                fully_shard(layer, offload_policy=policy)
            fully_shard(self.model, offload_policy=policy)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.stepper = self.optim
        if how in ("overlapped", "in_backward", "delayed"):
            self.stepper = OverlappedStep(self.optim, delayed=how == "delayed")
            # the host thread's own intra-op threads (a benchmark's reach into the pool)
            self.stepper._pool.submit(torch.set_num_threads, host_threads).result()
        self.clip = clip
        self.times: list[float] = []
        self.losses: list[float] = []
        self._started: float | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        started = time.perf_counter()
        loss = lm_loss(self.model(x), y)
        if self.how == "in_backward":
            with self.stepper.stepping_in_backward():
                loss.backward()
        else:
            loss.backward()
        if not self.clip:
            self.stepper.step()
        elif self.how == "fsdp2":
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optim.step()
        else:
            norm = grad_norm(self.model.parameters())
            self.optim.grad_scale = 1.0 / clip_coefficient(norm, 1.0)
            self.optim.found_inf = (~torch.isfinite(norm)).float()
            self.stepper.step()
            self.optim.grad_scale = self.optim.found_inf = None
        self.optim.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        # a step's time runs from its forward to the next one's: the overlapped host
        # step ends inside the next forward, and is counted there
        if self._started is not None:
            self.times.append(started - self._started)
        self._started = started


def _measure(cfg: GPTConfig, rounds: int, block: int, batch: int, clip: bool,
             host_threads: int) -> dict:
    hows = ("first", "overlapped", "delayed", "fsdp2") + (() if clip else ("in_backward",))
    copies = [Copy(cfg, how, clip, host_threads) for how in hows]
    step = 0
    for round_ in range(rounds + 1):  # the first round warms up
        # each copy trains a block of steps alone (another copy's work beside a host
        # step would hide it), the order turned each round against the machine's drift
        for copy in (copies if round_ % 2 else reversed(copies)):
            copy.times_before = len(copy.times)
            copy._started = None
            for i in range(block):
                x, y = token_batch(step + i, batch, cfg.vocab_size, cfg.seq_len)
                copy.step(x, y)
            if copy.how in ("overlapped", "in_backward", "delayed"):
                copy.stepper.wait()
            if round_ == 0:
                del copy.times[copy.times_before:]
        step += block
    return {c.how: {"ms": statistics.median(c.times) * 1e3,
                    "spread": (min(c.times) * 1e3, max(c.times) * 1e3),
                    "losses": c.losses} for c in copies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=5, help="steps per copy per round")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="w1",
                        help="w1; step-bound (d=1024, 6 layers, vocab 16384, batch 2 x 64); "
                             "tiny (a smoke test)")
    parser.add_argument("--no-clip", action="store_true",
                        help="no clipping; adds a copy stepping during backward")
    parser.add_argument("--host-threads", type=int, default=1,
                        help="intra-op threads of the host-step thread")
    args = parser.parse_args()
    cfg, batch = SHAPES[args.shape]
    # five copies of the step-bound shape take minutes on a busy machine
    result = run_distributed(_measure, 1, cfg, args.rounds, args.block, batch,
                             not args.no_clip, args.host_threads, timeout=3600)[0]
    first, overlapped, fsdp2 = result["first"], result["overlapped"], result["fsdp2"]
    print(f"torch {torch.__version__}, 1 rank (gloo), {args.rounds} rounds of {args.block} "
          f"steps per copy, "
          f"shape {args.shape}, {'no clip' if args.no_clip else 'clip to norm 1'}, "
          f"{args.host_threads} host-step thread(s)")
    print("| step | median ms | range ms | / stepping first | / FSDP2 |")
    print("|---|---:|---:|---:|---:|")
    rows = [("fullshard, step first", first), ("fullshard, OverlappedStep", overlapped)]
    if "in_backward" in result:
        rows.append(("fullshard, OverlappedStep stepping in backward", result["in_backward"]))
    rows.append(("fullshard, OverlappedStep(delayed=True)", result["delayed"]))
    for name, r in rows + [("FSDP2 CPUOffloadPolicy", fsdp2)]:
        print(f"| {name} | {r['ms']:.1f} | {r['spread'][0]:.1f}-{r['spread'][1]:.1f} | "
              f"{r['ms'] / first['ms']:.2f} | {r['ms'] / fsdp2['ms']:.2f} |")
    worst = max(abs(a - b) for other in [overlapped] + ([result["in_backward"]]
                                                     if "in_backward" in result else [])
                for a, b in zip(first["losses"], other["losses"]))
    print(f"largest loss difference, step first vs OverlappedStep: {worst:.3g}")
    stale = max(abs(a - b) for a, b in zip(first["losses"], result["delayed"]["losses"]))
    print(f"largest loss difference, step first vs delayed (one step stale): {stale:.3g}")
    assert worst == 0.0, "OverlappedStep must give the same bits as stepping first"


if __name__ == "__main__":
    main()
