"""Everything a GPU window checks, in one command and one report (`make gpu-check`).

    python benchmarks/gpu_check.py --out DIR --wheels .gpu-wheels   # on the GPU box
    python benchmarks/gpu_check.py --out DIR --dry-run              # here, CPU, tiny shapes

Steps, in order, each a process of its own with a time limit inside one budget
(--budget-s; the whole check stays under 9 minutes):

  environment   python, torch, CUDA, the GPU, the packages fullshard uses
  install       (--wheels) what `make gpu-wheels` fetched, without a package registry:
                tyro and tomli-w, then torchao (fails alone), then fullshard itself
                editable and without dependencies, against the box's torch
  cuda-lane     tests/gpu on NCCL (make test-gpu)
  trainer       benchmarks/trainer.py: `fullshard train` steps against a plain loop,
                gpt2-124m at batch 8, eager, with the trainer's memory estimate beside
                its measured CUDA peak
  trainer-compiled   the same, both compiled
  memory        benchmarks/gpu_memory.py: the estimate against the measured peak under a
                24 GiB cap: plain, QLoRA (NF4 + LoRA) and float8 (skipped, with a line
                saying so, where torchao or peft is missing)
  checkpoint    benchmarks/checkpoint_io.py --backend nccl: fullshard.checkpoint save and
                load (checksums verified) against torch DCP, the state on the GPU
  gpu-bench     benchmarks/gpu.py --quick: G1-G4 x {fullshard, FSDP2, plain loop} and
                Megatron-FSDP on G1 and G2, last,
                so that it has whatever the budget has left (about 290 s on an H200)

DIR gets gpu-check.md (the report, rewritten after every step, so a window that ends
early still brings back what ran), gpu-check.log (every step's output) and the JSON
the benchmarks write. The dry run runs the same steps on CPU with tiny shapes (the CUDA
lane is collected, not run; no install; nothing compiled), so this script cannot rot
unnoticed: tests/repo/test_gpu_check.py runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
BENCH = os.path.join(ROOT, "benchmarks")
NOTHING_RAN = 5  # pytest's exit status when every test was skipped or none collected
PACKAGES = ("fullshard", "tyro", "tomli_w", "torchao", "megatron_fsdp", "peft", "transformers",
            "numpy",
            "tqdm", "xxhash", "safetensors", "pytest")


@dataclass
class Step:
    name: str
    commands: list[list[str]]  # run one after the other; the step fails at the first failure
    limit_s: int
    env: dict = field(default_factory=dict)
    summary: object = None  # (output, out_dir) -> list of report lines


@dataclass
class Outcome:
    status: str
    seconds: float = 0.0
    lines: list = field(default_factory=list)


def _last_lines(text: str, starts: tuple[str, ...]) -> list[str]:
    return [x.strip() for x in text.splitlines() if x.strip().startswith(starts)]


def _pytest_summary(output: str, _out: str) -> list[str]:
    lines = [x for x in output.strip().splitlines() if " passed" in x or " failed" in x
             or " skipped" in x or " error" in x or "collected" in x or "SKIPPED" in x]
    return lines[-3:]


def _bench_summary(output: str, out: str) -> list[str]:
    return _last_lines(output, ("device:", "|", "G1 ", "G2 ", "G3 ", "G4 "))


def _trainer_summary(output: str, _out: str) -> list[str]:
    lines = _last_lines(output, ("preset ", "|", "trainer / plain"))
    for x in output.splitlines():
        if x.startswith("RESULT "):
            r = json.loads(x[len("RESULT "):])
            if r["estimate_error"] is not None:
                lines.append(f"memory: estimated {r['estimated_peak_bytes'] / 2**20:,.0f} MiB, "
                             f"measured {r['measured_peak_bytes'] / 2**20:,.0f} MiB "
                             f"({r['estimate_error']:+.1%}) in the trainer's first step")
    return lines


def _checkpoint_summary(output: str, _out: str) -> list[str]:
    return _last_lines(output, ("checkpoint ", "|"))


def _memory_summary(output: str, _out: str) -> list[str]:
    return _last_lines(output, ("plain", "qlora", "float8"))


def steps(args: argparse.Namespace) -> list[Step]:
    dry, out = args.dry_run, args.out
    lane_env = {"FULLSHARD_TEST_LANE": "cuda", "OMP_NUM_THREADS": "1"}
    lane = [PY, "-m", "pytest", os.path.join(ROOT, "tests", "gpu"), "-q", "-rs",
            "-p", "no:cacheprovider"] + (["--collect-only"] if dry else [])
    bench = [PY, os.path.join(BENCH, "gpu.py"), "--json", os.path.join(out, "gpu-bench.json")]
    bench += (["--tiny", "--device", "cpu", "--nproc", "1", "--workloads", "G1,G3",
               "--impls", "plain,fullshard,fullshard-resident"] if dry else
              ["--quick", "--timeout", "120", "--workloads", "G1,G2,G3,G4",
               "--impls", "plain,fsdp2,fullshard,megatron,fullshard-resident"])
    trainer = [PY, os.path.join(BENCH, "trainer.py")] + (
        ["--preset", "debug", "--rounds", "1", "--block", "2"] if dry else
        ["--preset", "gpt2-124m", "--batch-size", "8", "--rounds", "6", "--block", "10"])
    memory = [PY, os.path.join(BENCH, "gpu_memory.py"), "--json",
              os.path.join(out, "gpu-memory.json")] + (["--dry-run"] if dry else [])
    checkpoint = [PY, os.path.join(BENCH, "checkpoint_io.py"), "--world-size", "1"] + (
        ["--repeats", "1"] if dry else ["--repeats", "3", "--backend", "nccl"])
    wheels = args.wheels
    pip = [PY, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels or "."]
    listed = [PY, "-m", "pip", "list", "--format=freeze"]
    return [
        Step("install", [] if dry or not wheels else [
            pip + ["tyro", "tomli-w"], pip + ["--no-deps", "-e", ROOT], listed], 90),
        Step("install-torchao", [] if dry or not wheels else [pip + ["torchao"]], 30),
        Step("install-megatron", [] if dry or not wheels else [
            pip + ["--no-deps", "megatron-fsdp", "einops"]], 30),
        Step("cuda-lane", [lane], 150, lane_env, _pytest_summary),
        Step("trainer", [trainer], 60, {}, _trainer_summary),
        Step("trainer-compiled", [] if dry else [trainer + ["--compile"]], 90, {},
             _trainer_summary),
        Step("memory", [memory], 90, {}, _memory_summary),
        Step("checkpoint", [checkpoint], 60, {"OMP_NUM_THREADS": "1"}, _checkpoint_summary),
        # last, with what the budget has left: eleven runs of ~25 s on an H200, and
        # Megatron-FSDP's two (G1, G2); G4 last, the one a short budget cuts
        Step("gpu-bench", [bench], 360, {}, _bench_summary),
    ]


def environment() -> list[str]:
    from importlib import metadata
    lines = [f"python {platform.python_version()}, torch {torch.__version__} "
             f"(CUDA {torch.version.cuda}), {platform.node()}"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        lines.append(f"{n} x {torch.cuda.get_device_name(0)} "
                     f"({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)")
    else:
        lines.append("no CUDA device visible")
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} -")
    lines.append(", ".join(found))
    return lines


def run_step(step: Step, remaining: float, log) -> Outcome:
    if not step.commands:
        return Outcome("skipped (dry run)" if not step.name.startswith("install")
                       else "skipped (no --wheels, or dry run)")
    limit = min(step.limit_s, remaining)
    if limit < 10:
        return Outcome("not run: the time budget was spent")
    started, output = time.monotonic(), ""
    for cmd in step.commands:
        left = limit - (time.monotonic() - started)
        log.write(f"\n===== {step.name}: {' '.join(cmd)}\n")
        log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **step.env)
        # a session of its own: on a time-out the whole tree (torchrun's ranks too) goes
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            log.write(text)
            output += text
            return Outcome(f"timed out after {limit:.0f} s", time.monotonic() - started,
                           _summarize(step, output))
        log.write(text)
        log.flush()
        output += text
        if proc.returncode == NOTHING_RAN and step.summary is _pytest_summary:
            return Outcome("skipped: pytest ran no test (see below)",
                           time.monotonic() - started, _summarize(step, output))
        if proc.returncode != 0:
            tail = text.strip().splitlines()[-8:]
            return Outcome(f"failed (exit {proc.returncode})", time.monotonic() - started,
                           _summarize(step, output) + ["last lines:"] + tail)
    return Outcome("ok", time.monotonic() - started, _summarize(step, output))


def _summarize(step: Step, output: str) -> list[str]:
    if step.summary is None:
        return []
    try:
        return step.summary(output, "")
    except (ValueError, KeyError, TypeError) as err:  # a summary never hides the outcome
        return [f"(summary unreadable: {err})"]


def report(path: str, args, env_lines: list[str], outcomes: dict[str, Outcome],
           started: float) -> None:
    mode = "DRY RUN on CPU with tiny shapes: no figure here is a GPU measurement" \
        if args.dry_run else "GPU run"
    rows = [f"# fullshard gpu-check ({mode})", "",
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{time.monotonic() - started:.0f} s of a {args.budget_s} s budget", ""]
    rows += [f"- {x}" for x in env_lines] + [""]
    rows += ["| step | status | seconds |", "|---|---|---:|"]
    rows += [f"| {name} | {o.status} | {o.seconds:.0f} |" for name, o in outcomes.items()]
    for name, o in outcomes.items():
        if o.lines:
            rows += ["", f"## {name}", "", "```", *o.lines, "```"]
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the report and logs")
    parser.add_argument("--wheels", help="folder of wheels to install first (make gpu-wheels)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no install")
    parser.add_argument("--budget-s", type=int, default=530,
                        help="seconds for every step together (default 530)")
    parser.add_argument("--only", help="comma-separated step names (default: all)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    path = os.path.join(args.out, "gpu-check.md")
    env_lines = environment()
    outcomes: dict[str, Outcome] = {}
    chosen = set(args.only.split(",")) if args.only else None
    with open(os.path.join(args.out, "gpu-check.log"), "w") as log:
        for step in steps(args):
            if chosen is not None and step.name not in chosen:
                continue
            remaining = args.budget_s - (time.monotonic() - started)
            outcomes[step.name] = run_step(step, remaining, log)
            if step.name.startswith("install") and outcomes[step.name].status == "ok":
                env_lines = environment()  # what is there now
            print(f"gpu-check: {step.name}: {outcomes[step.name].status}", flush=True)
            report(path, args, env_lines, outcomes, started)
    report(path, args, env_lines, outcomes, started)
    print(f"gpu-check: report in {path}")
    bad = [n for n, o in outcomes.items() if not (o.status == "ok" or o.status.startswith(
        "skipped")) and n != "install-torchao"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
