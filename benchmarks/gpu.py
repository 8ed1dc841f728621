"""fullshard vs PyTorch FSDP2 vs a plain single-device loop on the GPU workloads.

    python benchmarks/gpu.py                          # G1-G4, every implementation
    python benchmarks/gpu.py --workloads G2 --impls fullshard,fsdp2
    python benchmarks/gpu.py --tiny --device cpu      # the same code on CPU, tiny shapes
    python benchmarks/gpu.py --workloads G2 --impls fullshard,fullshard-symm  # symmetric memory on/off
    python benchmarks/gpu.py --workloads G2 --impls plain,fsdp2,fullshard,fullshard-graph
    python benchmarks/gpu.py --workloads G3 --impls fsdp2,fullshard,fullshard-resident

Workloads (Llama-style blocks, bf16 compute, fp32 reduce and optimizer, fused AdamW):
  G1 compute-bound: d=1536, 24 layers, 12 heads, vocab 32000, batch 8 x 1024
  G2 overhead-bound: d=192, 64 layers, 3 heads, vocab 4096, batch 8 x 128
  G3 G1 with CPU offload (fused CPU AdamW; no plain-loop counterpart)
  G4 G1 with per-block activation checkpointing and per-block torch.compile

Implementations: plain (one device, no sharding), fsdp2 (torch's fully_shard), fullshard,
megatron (Megatron-FSDP 0.6.1's fully_shard, ZeRO-3, one unit per block; CUDA only, G1 and
G2: it has no CPU offload, and compiled blocks are not its unit class; skipped with the
reason where it cannot run or is not installed). On request: fullshard-symm (all-gathers
into NCCL symmetric memory) and fullshard-graph (the whole step captured once by
``fullshard.capture_step`` and replayed: Note [capturing the steady step]; CUDA only, not
G3, whose offload it refuses; its optimizer is the fused AdamW with ``capturable=True``,
its warm-up steps train on the first batch before the timed ones, so its losses are not
the others', and its step is not split into phases) and fullshard-resident (G3 only: the
offloaded blocks keep a copy of their shards on the device, ``CPUOffloadPolicy(
params_on_device=True)``, so each step copies them to the device once instead of at every
gather; Note [parameters kept on the device]).

Each (implementation, workload) runs in its own set of processes (world size = every
visible GPU), so memory figures start clean. On one GPU fullshard runs its collectives
on the one rank as FSDP2 does (``fullshard.testing.collectives_at_one_rank``: gathers,
reductions, the copy stream and pooled buffers), not its one-rank shortcuts. G3 joins
gloo beside NCCL ("cpu:gloo,cuda:nccl"): clipping reduces the offloaded (host) gradients
through the mesh's group. Per run: median step time over the timed
steps (no synchronization inside a step), tokens/s, MFU (against --peak-tflops), peak
allocated and reserved memory, and a per-phase split (forward, backward, clip,
optimizer) from separate steps synchronized at each phase boundary. The table gives
fullshard's ratio to FSDP2 and to the plain loop; the losses show the three train
the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import Llama, LlamaConfig  # noqa: E402

from fullshard.testing import free_port  # noqa: E402

IMPLS = ("plain", "fsdp2", "fullshard", "megatron")
# on request only (--impls): fullshard with its all-gathers into NCCL symmetric memory
# (set_symm_mem_for_comm), to measure against "fullshard"
# fullshard's step captured in one CUDA graph and replayed (fullshard.capture_step)
EXTRA_IMPLS = ("fullshard-symm", "fullshard-graph", "fullshard-resident")
H100_BF16_DENSE_TFLOPS = 989.0


@dataclass(frozen=True)
class Workload:
    cfg: LlamaConfig
    batch: int
    seq: int
    offload: bool = False
    compile_and_checkpoint: bool = False
    warmup: int = 3
    steps: int = 10


G1 = LlamaConfig(vocab_size=32000, d_model=1536, n_layers=24, n_heads=12)
WORKLOADS = {
    "G1": Workload(G1, 8, 1024),
    "G2": Workload(LlamaConfig(vocab_size=4096, d_model=192, n_layers=64, n_heads=3), 8, 128,
                   steps=20),
    "G3": Workload(G1, 8, 1024, offload=True, warmup=2, steps=5),
    "G4": Workload(G1, 8, 1024, compile_and_checkpoint=True, warmup=3),
}
TINY = LlamaConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=2)


def tiny(w: Workload) -> Workload:
    return Workload(TINY, 2, 32, w.offload, w.compile_and_checkpoint, warmup=2, steps=3)


# -- one run (a worker process) -----------------------------------------------------------
def _device() -> torch.device:
    if torch.cuda.is_available() and os.environ.get("BENCH_DEVICE", "cuda") == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _prepare_blocks(model: Llama, w: Workload) -> None:
    if not w.compile_and_checkpoint:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(checkpoint_wrapper(block))


def build(impl: str, w: Workload, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Llama(w.cfg)
    model.init_weights()
    _prepare_blocks(model, w)
    if impl == "plain":
        return model.to(device)
    if impl == "megatron":
        return model  # sharded with its optimizer: _megatron
    if impl in ("fullshard", "fullshard-symm", "fullshard-graph", "fullshard-resident"):
        from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from fullshard.testing import collectives_at_one_rank
        # one GPU: gather and reduce as FSDP2 does at world size 1 (its collectives run on
        # one rank), not fullshard's one-rank shortcuts: the path larger worlds take
        collectives_at_one_rank()
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32))
    if w.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda") \
            if impl != "fullshard-resident" else CPUOffloadPolicy(
                pin_memory=device.type == "cuda", params_on_device=True)
    else:
        model.to(device)
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if impl == "fullshard-symm":
        for module in model.modules():
            if hasattr(module, "set_symm_mem_for_comm"):
                module.set_symm_mem_for_comm()
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(w: Workload, device: torch.device, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    out = []
    for _ in range(n):
        x = torch.randint(0, w.cfg.vocab_size, (w.batch, w.seq + 1), generator=gen)
        out.append((x[:, :-1].to(device), x[:, 1:].to(device)))
    return out


def _profile(step, batches, device: torch.device, path: str) -> None:
    """Two more steps under torch.profiler; the ops that took the most device time and
    the most host time, one table each, into ``path`` (where a ratio comes from)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for x, y in batches:
            step(x, y, split=False)
        _sync(device)
    averages = prof.key_averages()
    device_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "w") as f:
        for key in dict.fromkeys((device_key, "self_cpu_time_total")):
            f.write(f"sorted by {key} ({len(batches)} steps)\n")
            f.write(averages.table(sort_by=key, row_limit=25, max_name_column_width=60))
            f.write("\n\n")


def _clip_and_step(impl: str, w: Workload, model, optim):
    """Clip to norm 1 and step, each implementation as its users would. fullshard with
    offload steps as its trainer does: the norm from the gradients' device-side norms,
    the clip applied inside the fused CPU step (Note [the clip applied inside the step])
    and the offloaded blocks stepped on a host thread while the next forward runs
    (fullshard.OverlappedStep); the others clip with torch's clip_grad_norm_ first."""
    if impl == "megatron":
        def megatron(mark):
            # its reduce-scatters finished and the gradients attached to the optimizer's
            # (distributed) parameters first: what its patched step would do, before clipping
            model.finish_grad_sync()
            torch.nn.utils.clip_grad_norm_(
                [p for group in optim.param_groups for p in group["params"]], 1.0)
            mark()
            optim.step()
        return megatron
    if impl not in ("fullshard", "fullshard-resident") or not w.offload:
        def plain(mark):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            mark()
            optim.step()
        return plain
    from fullshard import OverlappedStep
    from fullshard.grad_norm import clip_coefficient, grad_norm
    stepper = OverlappedStep(optim)

    def overlapped(mark):
        norm = grad_norm(model.parameters())
        optim.grad_scale = (1.0 / clip_coefficient(norm, 1.0)).cpu()
        optim.found_inf = (~torch.isfinite(norm)).float().cpu()
        mark()
        stepper.step()
        optim.grad_scale = optim.found_inf = None
    return overlapped


def _megatron(model: torch.nn.Module, device: torch.device):
    """Megatron-FSDP (``megatron_fsdp.fully_shard``, ZeRO-3: parameters, gradients and
    optimizer states sharded) with the others' precision: bf16 compute weights, fp32 main
    weights, gradients and reduction; one unit per block, as the others wrap. Its compute
    weights are the model cast to bf16 first, so its fp32 main weights start from
    bf16-rounded values: its losses agree with the others' to bf16 rounding, not exactly."""
    import megatron_fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from llama import Block
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = model.to(device=device, dtype=torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                main_grads_dtype=torch.float32,
                                                grad_comm_dtype=torch.float32)
    return megatron_fsdp.fully_shard(model, optim, device_mesh=mesh, dp_shard_dim="dp",
                                     fsdp_unit_modules=[Block], zero_dp_strategy=3,
                                     mixed_precision_policy=policy, device=device)


def run(impl: str, w: Workload, peak_tflops: float, profile_to: str | None = None) -> dict:
    device = _device()
    model = build(impl, w, device)
    if impl == "megatron":
        model, optim = _megatron(model, device)
    else:  # fused on CPU too (offload); a captured step keeps its step count on the device
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True,
                                  capturable=impl == "fullshard-graph")
    clip_and_step = _clip_and_step(impl, w, model, optim)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if impl == "plain"
                else torch.autocast(device.type, enabled=False))

    def loss_of(x, y):
        with autocast:
            logits = model(x)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    phases: dict[str, list[float]] = {"forward": [], "backward": [], "clip": [], "optimizer": []}
    captured = None  # fullshard-graph: the captured step, replayed by step()

    def step(x, y, split: bool) -> float:
        if captured is not None:  # one graph: no phase boundary to synchronize at
            return captured(x, y).item()
        marks = [time.perf_counter()]

        def mark():
            if split:
                _sync(device)
                marks.append(time.perf_counter())
        loss = loss_of(x, y)
        mark()
        loss.backward()
        mark()
        clip_and_step(mark)
        optim.zero_grad(set_to_none=True)
        mark()
        if split:
            for name, a, b in zip(phases, marks, marks[1:]):
                phases[name].append((b - a) * 1e3)
        return loss.item()  # one sync per step: the loss every trainer logs

    n_split = 3
    batches = _batches(w, device, w.warmup + w.steps + n_split)
    if impl == "fullshard-graph":
        captured = _capture(model, optim, loss_of, clip_and_step, batches[0], w.warmup)
    losses, times = [], []
    for i, (x, y) in enumerate(batches[:w.warmup + w.steps]):
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(x, y, split=False))
        times.append((time.perf_counter() - t0) * 1e3)
    for x, y in batches[w.warmup + w.steps:]:
        step(x, y, split=True)
    if profile_to:
        _profile(step, batches[:2], device, profile_to)
    step_ms = statistics.median(times[w.warmup:])
    world = dist.get_world_size()
    tokens = w.batch * w.seq  # per rank
    if device.type == "cuda":
        alloc = torch.cuda.max_memory_allocated(device) / 2**30
        reserved = torch.cuda.max_memory_reserved(device) / 2**30
    else:  # peak RSS (ru_maxrss is in KiB on Linux)
        alloc = reserved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {
        "impl": impl, "world": world, "device": _device_name(device),
        "torch": torch.__version__, "step_ms": step_ms,
        "tokens_per_s": tokens * world / (step_ms / 1e3),
        "mfu": tokens * w.cfg.flops_per_token(w.seq) / (step_ms / 1e3) / (peak_tflops * 1e12),
        "peak_alloc_gib": alloc, "peak_reserved_gib": reserved,
        "phases_ms": {k: statistics.median(v) if v else float("nan") for k, v in phases.items()},
        "losses": losses, "params": w.cfg.num_params(),
    }


def _capture(model, optim, loss_of, clip_and_step, batch, warmup: int):
    """fullshard.capture_step of one whole step (forward, backward, clip, optimizer,
    zero_grad) on copies of ``batch``, after ``warmup`` eager steps on it."""
    import fullshard

    def whole_step(x, y):
        loss = loss_of(x, y)
        loss.backward()
        clip_and_step(lambda: None)
        optim.zero_grad(set_to_none=True)
        return loss
    x, y = batch
    return fullshard.capture_step(whole_step, x.clone(), y.clone(), model=model,
                                  optimizer=optim, warmup=max(warmup, 2))


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def worker(args: argparse.Namespace) -> None:
    device = _device()
    w = WORKLOADS[args.workload]
    # offloaded gradients are host tensors on the CUDA mesh: clipping reduces them through
    # the mesh's group, which then needs gloo beside NCCL (as torchtitan initializes it)
    backend = "gloo" if device.type != "cuda" else "cpu:gloo,cuda:nccl" if w.offload else "nccl"
    dist.init_process_group(backend)
    try:
        if args.quick:  # a run's cost is mostly its start and compile, not its steps:
            # 10 timed steps (5 for G3) where 5 gave ratios 10-24% apart from run to run
            w = Workload(w.cfg, w.batch, w.seq, w.offload, w.compile_and_checkpoint,
                         warmup=3, steps=min(w.steps, 10))
        profile_to = None
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            profile_to = os.path.join(
                args.profile, f"{args.workload}-{args.impl}-rank{dist.get_rank()}.txt")
        result = run(args.impl, tiny(w) if args.tiny else w, args.peak_tflops, profile_to)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------
def launch(impl: str, workload: str, args: argparse.Namespace) -> dict | None:
    nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 1) or 1
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", os.path.abspath(__file__), "--worker",
           "--impl", impl, "--workload", workload, "--peak-tflops", str(args.peak_tflops)]
    if args.tiny:
        cmd.append("--tiny")
    if args.quick:
        cmd.append("--quick")
    if args.profile:
        cmd += ["--profile", os.path.abspath(args.profile)]
    env = dict(os.environ, BENCH_DEVICE=args.device, OMP_NUM_THREADS=os.environ.get(
        "OMP_NUM_THREADS", "1"))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{impl} on {workload}: no result within --timeout {args.timeout:.0f} s",
              file=sys.stderr)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    print(f"{impl} on {workload} failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
    return None


def _megatron_skipped(w: Workload, device: str) -> str | None:
    """Why Megatron-FSDP does not run ``w`` here, or None."""
    import importlib.util
    if importlib.util.find_spec("megatron_fsdp") is None:
        return "megatron_fsdp is not installed; make gpu-wheels carries megatron-fsdp 0.6.1"
    if device != "cuda":
        return "Megatron-FSDP runs on CUDA only (its constructor asks torch.cuda for the device)"
    if w.offload:
        return "Megatron-FSDP's fully_shard has no CPU offload"
    if w.compile_and_checkpoint:
        return "blocks compiled before sharding are no longer Megatron-FSDP's unit class"
    return None


def _graph_skipped(w: Workload, device: str) -> str | None:
    """Why fullshard.capture_step does not run ``w`` here, or None."""
    if device != "cuda":
        return "a CUDA graph needs CUDA"
    if w.offload:
        return "capture_step refuses CPU offload (docs/errors.md E374)"
    return None


def table(results: dict[tuple[str, str], dict]) -> str:
    rows = ["| workload | impl | step ms | tokens/s | MFU | peak alloc GiB | peak reserved GiB "
            "| fwd / bwd / clip / optim ms | vs FSDP2 | vs plain | last loss |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for (workload, impl), r in results.items():
        fsdp2, plain = results.get((workload, "fsdp2")), results.get((workload, "plain"))
        ph = r["phases_ms"]
        split = " / ".join(f"{ph[k]:.1f}" for k in ("forward", "backward", "clip", "optimizer"))
        rows.append(
            f"| {workload} | {impl} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{100 * r['mfu']:.1f}% | {r['peak_alloc_gib']:.2f} | {r['peak_reserved_gib']:.2f} "
            f"| {split} | {_ratio(r, fsdp2)} | {_ratio(r, plain)} | {r['losses'][-1]:.4f} |")
    return "\n".join(rows)


def _ratio(r: dict, base: dict | None) -> str:
    return f"{r['step_ms'] / base['step_ms']:.2f}" if base else "–"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="G1,G2,G3,G4")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"of {', '.join(IMPLS + EXTRA_IMPLS)}; "
                             f"{', '.join(EXTRA_IMPLS)} on request only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"])
    parser.add_argument("--nproc", type=int, help="processes (default: every visible GPU)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a quick check)")
    parser.add_argument("--quick", action="store_true",
                        help="3 warm-up and at most 10 timed steps (a short GPU window)")
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                        help="the device's dense bf16 peak, for MFU (default: H100 SXM)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("--profile", metavar="DIR",
                        help="after the timed steps, two steps under torch.profiler: the "
                             "top ops by device and host time, one file per run and rank")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    for workload in args.workloads.split(","):
        for impl in args.impls.split(","):
            if impl == "plain" and WORKLOADS[workload].offload:
                continue  # a plain loop does not offload
            if impl == "fullshard-graph" and (why := _graph_skipped(WORKLOADS[workload],
                                                                    args.device)):
                print(f"fullshard-graph on {workload}: skipped ({why})", file=sys.stderr,
                      flush=True)
                continue
            if impl == "fullshard-resident" and not WORKLOADS[workload].offload:
                print(f"fullshard-resident on {workload}: skipped (it keeps offloaded "
                      "parameters on the device; the workload offloads nothing)",
                      file=sys.stderr, flush=True)
                continue
            if impl == "fullshard-symm" and args.device != "cuda":
                print(f"fullshard-symm on {workload}: skipped (symmetric memory needs CUDA "
                      "and NCCL)", file=sys.stderr, flush=True)
                continue
            if impl == "megatron" and (why := _megatron_skipped(WORKLOADS[workload], args.device)):
                print(f"megatron on {workload}: skipped ({why})", file=sys.stderr, flush=True)
                continue
            r = launch(impl, workload, args)
            if r is not None:
                results[(workload, impl)] = r
                print(f"{workload} {impl}: {r['step_ms']:.1f} ms/step", file=sys.stderr,
                      flush=True)
            if args.json:  # after every run: a window that ends early keeps what ran
                with open(args.json, "w") as f:
                    json.dump({f"{w}/{i}": r for (w, i), r in results.items()}, f, indent=1)
    if results:
        first = next(iter(results.values()))
        print(f"device: {first['device']} x {first['world']}, torch {first['torch']}")
        print(table(results))


if __name__ == "__main__":
    main()
