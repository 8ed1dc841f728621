"""The trainer's steps against a plain single-device loop on the same model and batches.

    OMP_NUM_THREADS=1 python benchmarks/trainer.py                    # CPU: shakespeare preset
    python benchmarks/trainer.py --preset gpt2-124m --batch-size 8     # one GPU
    python benchmarks/trainer.py --compile                              # both compiled
    python benchmarks/trainer.py --profile 5       # and where 5 steps of each spend their time

One process, world size 1. The trainer is ``fullshard.train.Trainer`` itself, with
evaluation, checkpoints and the final sample switched off, so what is timed is what
every step of a run costs: its micro-batches, clipping, the optimizer, the per-step
statistics gather, metrics.jsonl and the progress line. The plain loop is what a user
writes by hand: the same model (same initial weights), the same batches, AdamW with
the same groups, clipping, bf16 autocast where the trainer computes in bf16, and one
``loss.item()`` per step. Blocks of steps alternate between the two (noise hits both
alike); the figure is the median step time of each, and the ratio of tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from fullshard.gpt import lm_loss
from fullshard.testing import free_port
from fullshard.train.config.schema import get_preset
from fullshard.train.launch.launcher import Worker
from fullshard.train.loop import Trainer, build_optimizers
from fullshard.train.model import COMPUTE_DTYPES, build_workload, compile_blocks


class StepsOnly(Trainer):
    """The trainer without what a run does only now and then."""

    def _evaluate(self) -> float:
        return float("nan")

    def _save(self) -> None:
        pass

    def _print_sample(self) -> None:
        pass

    def _record(self, record: dict) -> None:  # metrics.jsonl, without the plot
        if self.log is not None:
            record.pop("val_loss", None)
            self.log.write(record)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trainer_block(trainer: StepsOnly, steps: int) -> float:
    """Run ``steps`` more trainer steps; the mean seconds per step."""
    device = trainer.worker.device
    _sync(device)
    start = time.perf_counter()
    trainer.cfg = dataclasses.replace(trainer.cfg, steps=trainer.step + steps)
    trainer._train()
    _sync(device)
    return (time.perf_counter() - start) / steps


class PlainLoop:
    def __init__(self, cfg, device: torch.device, use_compile: bool):
        workload = build_workload(cfg, 0)
        self.model = workload.model.to(device)
        if use_compile:
            compile_blocks(self.model)
        [self.optimizer] = build_optimizers(self.model, cfg.optim)
        self.sampler_batches = workload
        self.cfg, self.device = cfg, device
        dtype = COMPUTE_DTYPES[cfg.parallel.precision]
        self.autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                         else contextlib.nullcontext())

    def block(self, batches, steps: int) -> float:
        _sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            x, y = (t.to(self.device) for t in batches.next_batch())
            with self.autocast:
                logits = self.model(x)
            loss = lm_loss(logits.float(), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss.item()
        _sync(self.device)
        return (time.perf_counter() - start) / steps


def _profile(name: str, run, cuda: bool) -> None:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        run()
        wall = time.perf_counter() - started
    table = prof.key_averages()
    for key in (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        text = table.table(sort_by=key, row_limit=15, max_name_column_width=48)
        print(f"-- {name}: top operators by {key}\n{text}")
    # the footer's total of kernel time (streams summed) against the wall time
    found = re.search(r"Self (?:CUDA|device) time total: ([\d.]+)(us|ms|s)\b", text)
    if cuda and found:
        busy = float(found[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[found[2]]
        print(f"-- {name}: device busy {busy:.1f} ms of {wall * 1e3:.1f} ms wall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None,
                        help="default: gpt2-124m on a GPU, shakespeare on CPU")
    parser.add_argument("--batch-size", type=int, help="micro-batch size (default: preset's)")
    parser.add_argument("--compile", action="store_true", help="compile each block (both)")
    parser.add_argument("--block", type=int, default=5, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=5, help="blocks of each, alternating")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then profile STEPS steps of each (torch.profiler): the top "
                             "operators by self device time and by self host time")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # a free port: several runs may share the machine
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)

    preset = args.preset or ("gpt2-124m" if cuda else "shakespeare")
    cfg = get_preset(preset)
    batch = dataclasses.replace(cfg.batch, grad_accum=1,
                                batch_size=args.batch_size or cfg.batch.batch_size)
    cfg = dataclasses.replace(
        cfg, batch=batch, steps=1,
        eval=dataclasses.replace(cfg.eval, every=0, sample_tokens=0),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
        parallel=dataclasses.replace(cfg.parallel, compile=args.compile))
    with tempfile.TemporaryDirectory() as out:
        worker = Worker(0, 1, 0, 1, device)
        trainer = StepsOnly(cfg, out, worker)
        trainer._start_reporting(resume=False)
        trainer._train()  # the first step: lazy init, optimizer states
        # the trainer's own memory line (its first step), read before the plain loop's
        # model and optimizer states share the device: the estimate beside its measured peak
        estimated, measured = trainer.estimated_peak, trainer.measured_peak
        trainer.progress.close()  # its line counts to the run's last step, not the blocks'
        trainer.progress = None
        plain = PlainLoop(cfg, device, args.compile)
        plain.block(trainer.sampler, 2)  # warm up likewise
        trainer_times, plain_times = [], []
        for _ in range(args.rounds):
            trainer_times.append(trainer_block(trainer, args.block))
            plain_times.append(plain.block(trainer.sampler, args.block))
        if args.profile:
            _profile("fullshard train", lambda: trainer_block(trainer, args.profile), cuda)
            _profile("plain loop", lambda: plain.block(trainer.sampler, args.profile), cuda)
        trainer.log.close()
    tokens = batch.batch_size * batch.seq_len
    t, p = statistics.median(trainer_times), statistics.median(plain_times)
    where = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"preset {preset}, {tokens} tokens/step, {where}, torch "
          f"{torch.__version__}, compile={args.compile}")
    print("| loop | ms/step | tokens/s |\n|---|---:|---:|")
    print(f"| fullshard train | {t * 1e3:.1f} | {tokens / t:,.0f} |")
    print(f"| plain loop | {p * 1e3:.1f} | {tokens / p:,.0f} |")
    print(f"trainer / plain tokens/s: {p / t:.3f}")
    print("RESULT " + json.dumps({
        "preset": preset, "device": where, "torch": torch.__version__,
        "compile": args.compile, "tokens_per_step": tokens, "trainer_ms": t * 1e3,
        "plain_ms": p * 1e3, "trainer_over_plain_tokens_per_s": p / t,
        "estimated_peak_bytes": estimated, "measured_peak_bytes": measured,
        "estimate_error": (estimated - measured) / measured if estimated and measured
        else None}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
