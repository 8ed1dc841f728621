"""CPU offload side by side: fullshard, torch FSDP2's CPUOffloadPolicy and DeepSpeed
ZeRO-3 with the optimizer and parameters offloaded, at 2 ranks on the CPU (gloo).

    OMP_NUM_THREADS=1 python benchmarks/offload.py [--repeats 3] [--steps 8] [--warmup 2]
        [--shape default|step-bound|tiny] [--deepspeed-python PATH] [--impls fullshard,fsdp2,deepspeed,plain]

Every implementation trains the same GPT (``--shape default``: d=512, 6 blocks, vocab 16384,
tied embeddings, 27M parameters; batch 4 x 128 per rank; ``step-bound``: batch 1 x 128,
where the offload's own costs weigh more) from the same initial weights on
the same batches (each rank its own), with AdamW (lr 1e-4, torch's betas, eps and weight
decay) and gradient clipping to norm 1:

- ``fullshard``: ``fully_shard`` per block and the root with ``CPUOffloadPolicy``, stepped as
  the trainer steps: the gradient norm measured by ``fullshard.grad_norm``, the clip
  coefficient applied inside fused AdamW as its ``grad_scale`` (Note [the clip applied
  inside the step]), through ``OverlappedStep`` (the host step beside the next forward);
- ``fsdp2``: torch's ``fully_shard`` the same way with torch's ``CPUOffloadPolicy``,
  ``torch.nn.utils.clip_grad_norm_`` then fused AdamW;
- ``deepspeed``: ZeRO stage 3 with ``offload_optimizer`` and ``offload_param`` on the cpu,
  ``gradient_clipping`` 1.0, DeepSpeedCPUAdam in AdamW mode where its C++ op builds (else
  torch's AdamW, said in the output); skipped, with the reason, where DeepSpeed cannot be
  imported here or by ``--deepspeed-python`` (an interpreter with DeepSpeed, torch of the
  same version, and fullshard's dependencies; fullshard itself is found through
  PYTHONPATH);
- ``plain``: fullshard without offload (the floor), stepped like ``fullshard``.

Each implementation runs in its own pair of processes (so each rank's peak RSS is its
own), ``--repeats`` times, in an order that turns each repeat against the machine's drift.
A step's time runs from one step's forward to the next one's (an overlapped host step ends
inside the next forward and is counted there), on the slower rank. Prints the median step time over every
timed step of every repeat, its range, the ratio to FSDP2, the median time of each phase
(forward, backward, clip, optimizer step; with OverlappedStep the step phase is only
what stays on the main thread), each rank's peak RSS (the largest over repeats), and the
losses (the mean over ranks) of each step, and asserts that every implementation's losses
are FSDP2's to 1e-5: the maths is the same in all four (DeepSpeed's clip and its CPU AdamW
in AdamW mode included; the differences are rounding, ~1e-6 at the default shape).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

LR = 1e-4
CLIP = 1.0
TOLERANCE = 1e-5
IMPLS = ("fullshard", "fsdp2", "deepspeed", "plain")
LABELS = {"fullshard": "fullshard, CPU offload", "fsdp2": "FSDP2, CPUOffloadPolicy",
          "deepspeed": "DeepSpeed ZeRO-3, offload", "plain": "fullshard, no offload"}
PHASES = ("forward", "backward", "clip", "step")


def shapes() -> dict:
    from fullshard.gpt import GPTConfig

    model = GPTConfig(vocab_size=16384, seq_len=128, d_model=512, n_layers=6, n_heads=8)
    return {"default": (model, 4),
            # few tokens for the parameters: the copies, the collectives and the host step
            # weigh as they do next to a GPU's fast forward
            "step-bound": (model, 1),
            "tiny": (GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2,
                               n_heads=2), 2)}


def _build(impl: str, cfg, batch: int, lr: float):
    """The model (or DeepSpeed engine), and ``step(x, y) -> (loss, phase times)``."""
    from fullshard import CPUOffloadPolicy, OverlappedStep, fully_shard
    from fullshard.gpt import GPT, lm_loss
    from fullshard.grad_norm import clip_coefficient, grad_norm
    from fullshard.train.loop import step_or_skip

    torch.manual_seed(0)
    model = GPT(cfg)
    if impl == "deepspeed":
        return _build_deepspeed(model, batch, lr)
    if impl == "fsdp2":
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for layer in model.layers:
            torch_fully_shard(layer, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
        torch_fully_shard(model, offload_policy=TorchCPUOffloadPolicy(pin_memory=False))
    else:
        kwargs = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if impl == "fullshard" else {}
        for layer in model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    # the trainer steps an offloaded elementwise optimizer beside the next forward
    stepper = OverlappedStep(optim) if impl == "fullshard" else None

    def step(x, y):
        marks = [time.perf_counter()]
        loss = lm_loss(model(x), y)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        if impl == "fsdp2":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            marks.append(time.perf_counter())
            optim.step()
        else:
            norm = grad_norm(model.parameters())
            coefficient = clip_coefficient(norm, CLIP)
            marks.append(time.perf_counter())
            step_or_skip(optim, norm, coefficient, stepper.step if stepper else None)
        optim.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        return loss.item(), [b - a for a, b in zip(marks, marks[1:])]

    def finish():
        if stepper is not None:
            stepper.wait()

    return step, finish, {}


def _build_deepspeed(model, batch: int, lr: float):
    import logging

    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from fullshard.gpt import lm_loss

    deepspeed.utils.logger.setLevel(logging.WARNING)
    # what DeepSpeed's launcher would have set; one machine, so the local rank is the rank
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    # the process group is up (gloo): DeepSpeed adopts it rather than asking its cpu
    # accelerator for oneCCL
    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 3,
                              "offload_optimizer": {"device": "cpu", "pin_memory": False},
                              "offload_param": {"device": "cpu", "pin_memory": False}},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    info = {"version": f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}"}
    try:
        # adamw_mode: decoupled weight decay, as torch's AdamW; torch's defaults otherwise
        optim = DeepSpeedCPUAdam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=0.01, adamw_mode=True)
        info["optimizer"] = "DeepSpeedCPUAdam"
    except Exception as error:  # its C++ op failed to build: torch's AdamW instead
        optim = torch.optim.AdamW(model.parameters(), lr=lr)
        config["zero_force_ds_cpu_optimizer"] = False
        info["optimizer"] = f"torch AdamW (DeepSpeedCPUAdam failed: {type(error).__name__}: " \
                            f"{str(error).splitlines()[0] if str(error) else ''})"
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, config=config)

    def step(x, y):
        marks = [time.perf_counter()]
        loss = lm_loss(engine(x), y)
        marks.append(time.perf_counter())
        engine.backward(loss)
        marks.append(time.perf_counter())
        marks.append(time.perf_counter())  # the clip is inside engine.step
        engine.step()
        marks.append(time.perf_counter())
        return loss.item(), [b - a for a, b in zip(marks, marks[1:])]

    return step, lambda: None, info


def run_rank(impl: str, shape: str, warmup: int, steps: int, lr: float = LR) -> dict:
    """One rank's run: ``warmup`` steps, then ``steps`` timed ones."""
    from fullshard.testing.models import token_batch

    cfg, batch = shapes()[shape]
    rank, world = dist.get_rank(), dist.get_world_size()
    step, finish, info = _build(impl, cfg, batch, lr)
    losses, times, phases = [], [], []
    started = None
    for i in range(warmup + steps):
        x, y = token_batch(i * world + rank, batch, cfg.vocab_size, cfg.seq_len)
        now = time.perf_counter()
        if started is not None and i > warmup:
            times.append(now - started)
        started = now
        loss, phase = step(x, y)
        losses.append(loss)
        if i >= warmup:
            phases.append(phase)
    finish()
    times.append(time.perf_counter() - started)
    return {"losses": losses, "times": times, "phases": phases, "info": info,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def launch(impl: str, shape: str, warmup: int, steps: int, lr: float = LR) -> dict:
    """Both ranks' runs of ``impl``, folded: the losses averaged over ranks, each step's time
    the slower rank's, rank 0's phases."""
    from fullshard.testing import run_distributed

    ranks = run_distributed(run_rank, 2, impl, shape, warmup, steps, lr, timeout=1200.0)
    return {"losses": [statistics.fmean(step) for step in zip(*(r["losses"] for r in ranks))],
            "times": [max(step) for step in zip(*(r["times"] for r in ranks))],
            "phases": ranks[0]["phases"],
            "peak_rss": [r["peak_rss"] for r in ranks],
            "info": ranks[0]["info"]}


def _deepspeed_python(flag: str | None) -> tuple[str | None, str]:
    """The interpreter to run DeepSpeed with, or None and why not."""
    if importlib.util.find_spec("deepspeed") is not None:
        return sys.executable, ""
    if flag:
        return flag, ""
    return None, ("deepspeed is not importable here; pass --deepspeed-python with an "
                  "interpreter that has it")


def _launch_in(python: str, impl: str, args) -> dict:
    """``launch`` in a child ``python`` (DeepSpeed's interpreter, or this one)."""
    import fullshard

    env = dict(os.environ)
    src = str(Path(fullshard.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    out = subprocess.run([python, __file__, "--child", impl, "--shape", args.shape,
                          "--warmup", str(args.warmup), "--steps", str(args.steps)],
                         env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{impl} failed under {python}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(results: dict[str, dict]) -> dict[str, float]:
    """The largest loss difference of each implementation from FSDP2's."""
    base = results["fsdp2"]["losses"]
    return {impl: max(abs(a - b) for a, b in zip(r["losses"], base))
            for impl, r in results.items() if impl != "fsdp2"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--shape", choices=("default", "step-bound", "tiny"), default="default",
                        help="default (27M parameters, batch 4 x 128 per rank); step-bound "
                             "(the same model, batch 1 x 128); tiny (a smoke test)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--deepspeed-python", default=None,
                        help="an interpreter with DeepSpeed, where this one has none")
    parser.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(launch(args.child, args.shape, args.warmup, args.steps)))
        return
    impls = [i for i in args.impls.split(",") if i]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown or "fsdp2" not in impls:
        parser.error(f"--impls: {','.join(unknown) or 'fsdp2 missing'}; choose from "
                     f"{','.join(IMPLS)}, with fsdp2 (the ratios are to it)")
    pythons = {impl: sys.executable for impl in impls}
    skipped = {}
    if "deepspeed" in impls:
        python, why = _deepspeed_python(args.deepspeed_python)
        if python is None:
            skipped["deepspeed"] = why
            impls.remove("deepspeed")
        else:
            pythons["deepspeed"] = python
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for repeat in range(args.repeats):
        for impl in (impls if repeat % 2 == 0 else impls[::-1]):
            runs[impl].append(_launch_in(pythons[impl], impl, args))
    report(runs, skipped, args)


def report(runs: dict[str, list[dict]], skipped: dict[str, str], args) -> None:
    from fullshard.gpt import GPT

    cfg, batch = shapes()[args.shape]
    params = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"torch {torch.__version__}; 2 ranks (gloo, CPU); shape {args.shape} "
          f"({params / 1e6:.1f}M parameters, batch {batch} x {cfg.seq_len} per rank); "
          f"{args.repeats} repeats x {args.steps} timed steps after {args.warmup} warm-up")
    for impl, why in skipped.items():
        print(f"{impl}: skipped: {why}")
    for impl, rs in runs.items():
        for key, value in rs[0]["info"].items():
            print(f"{impl}: {key}: {value}")
    fsdp2 = statistics.median(t for r in runs["fsdp2"] for t in r["times"])
    print("| implementation | median step ms | range ms | / FSDP2 | "
          + " | ".join(f"{p} ms" for p in PHASES) + " | peak RSS MiB, rank 0 / 1 |")
    print("|---|---:|---:|---:|" + "---:|" * len(PHASES) + "---:|")
    for impl, rs in runs.items():
        times = [t * 1e3 for r in rs for t in r["times"]]
        med = statistics.median(times)
        phases = [statistics.median(p[k] for r in rs for p in r["phases"]) * 1e3
                  for k in range(len(PHASES))]
        rss = [max(r["peak_rss"][rank] for r in rs) / 2 ** 20 for rank in (0, 1)]
        print(f"| {LABELS[impl]} | {med:.0f} | {min(times):.0f}-{max(times):.0f} | "
              f"{med / 1e3 / fsdp2:.2f} | " + " | ".join(f"{p:.0f}" for p in phases)
              + f" | {rss[0]:.0f} / {rss[1]:.0f} |")
    first = {impl: rs[0] for impl, rs in runs.items()}
    for impl, r in first.items():
        print(f"losses {impl}: " + " ".join(f"{v:.6f}" for v in r["losses"]))
    for impl, rs in runs.items():
        assert all(r["losses"] == rs[0]["losses"] for r in rs), f"{impl}: repeats differ"
    differences = compare(first)
    for impl, worst in differences.items():
        print(f"largest loss difference, {impl} vs fsdp2: {worst:.3g}")
    bad = [i for i, worst in differences.items() if worst > TOLERANCE]
    assert not bad, f"losses differ from FSDP2's by more than {TOLERANCE}: {bad}"


if __name__ == "__main__":
    main()
