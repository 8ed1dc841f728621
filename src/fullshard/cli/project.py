"""``fullshard project`` and ``fullshard plan --gpus``: step time, tokens/s per GPU, MFU,
exposed communication and memory per rank at cluster scale (fullshard.projection).

    fullshard project --model llama3-8b --gpu h100 --gpus 8,128 --gpus-per-node 8 \\
        --batch 2 --seq 8192 --ac selective
    fullshard project --model path/to/config.json --gpu a100-40gb --batch 8 --grad-accum 4
    fullshard project --layers 32 --dim 4096 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256
    fullshard project --calibrate --preset shakespeare --gpus 1,2,4   # this machine (CPU)
    fullshard project --calibrate --gpu h100 --model llama3-8b --gpus 8,64   # on an H100
    fullshard plan --gpus 64 --gpu h100 --gpus-per-node 8 --model llama3-8b --batch 4 --seq 4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

from ..projection import (SHAPES, Cluster, Device, ModelShape, ProjectionError, Settings,
                          device_named, project, rank_configurations, shape_named, shape_of,
                          train_flags)
from ..projection.calibrate import (achieved_flops, calibrate_device, calibrated_cpu,
                                    fit_link, memory_bandwidth, sweep_collectives)
from ..projection.hardware import DEVICES, Link
from ..projection.project import CHECKPOINTING, STRATEGIES
from ..projection.settings import ATTENTION_KERNELS, COMPILE, KERNELS
from ..projection.shapes import hf_shape_fields
from ..projection.validation import ErrorBand, error_band
from ..bounds import Bounds, flag_type
from ..errors import ConfigError
from ..train.config.paths import check_hf_model
from .parsing import OneLineParser, check_seq

GiB = 2**30
# The bounds of every number these commands read (checked by bounds.py).
GPUS = Bounds(1, 2 ** 20)
PER_NODE = flag_type(int, Bounds(1, 1024))
BATCH = flag_type(int, Bounds(1, 2 ** 20))
SEQ = flag_type(int, Bounds(1, 2 ** 24))
EFFICIENCY = flag_type(float, Bounds(0.001, 1))
GBPS = flag_type(float, Bounds(0.001, 1e6))
MEMORY_GIB = flag_type(float, Bounds(0.001, 2 ** 20))
DIM = flag_type(int, Bounds(1, 2 ** 24))
ACCUM = flag_type(int, Bounds(1, 2 ** 20))
EP = flag_type(int, Bounds(1, 2 ** 20))
# the shape flags: each sets one dimension of --model's shape (or of a shape of its own)
SHAPE_FLAGS = {"layers": "n_layers", "dim": "d_model", "heads": "n_heads",
               "kv_heads": "n_kv_heads", "ffn": "ffn_hidden", "vocab": "vocab_size",
               "head_dim": "head_dim"}


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ProjectionError(f"--gpus takes GPU counts separated by commas, got {text!r}") \
            from None
    if not sizes:
        raise ProjectionError(f"--gpus takes GPU counts separated by commas, got {text!r}")
    for n in sizes:
        GPUS.check("--gpus", n)
    return sizes


def _arguments(parser: argparse.ArgumentParser, *, planning: bool) -> None:
    parser.add_argument("--model", default="llama3-8b",
                        help=f"model shape: {', '.join(SHAPES)}, or a Hugging Face model "
                             "folder or its config.json (default llama3-8b)")
    shape = parser.add_argument_group("shape", "each sets that dimension of --model's shape")
    for flag, help_ in (("layers", "blocks"), ("dim", "model width"), ("heads", "query heads"),
                        ("kv-heads", "key/value heads (grouped-query attention)"),
                        ("ffn", "MLP hidden width"), ("vocab", "vocabulary"),
                        ("head-dim", "head width (default dim / heads)")):
        shape.add_argument(f"--{flag}", type=DIM, help=help_)
    shape.add_argument("--mlp", choices=("swiglu", "gelu"),
                       help="gated (Llama) or GELU (GPT-2) MLP")
    shape.add_argument("--tied", action=argparse.BooleanOptionalAction,
                       help="output head tied to the token embedding")
    parser.add_argument("--gpu", default="h100", help="device: " + ", ".join(
        [f"{name} ({dev.source})" for name, dev in DEVICES.items()]))
    parser.add_argument("--gpus", required=planning, default="8", help="world size" + (
        "" if planning else "s, comma-separated (default 8)"))
    # --nodes-of is the older spelling, kept so existing command lines still run
    parser.add_argument("--gpus-per-node", "--nodes-of", dest="nodes_of", type=PER_NODE,
                        default=8, metavar="N", help="GPUs per node (default 8): collectives "
                        "over more ranks cross nodes, and a node's NICs are shared by this many")
    parser.add_argument("--batch", type=BATCH, default=1,
                        help="sequences per GPU per optimizer step (default 1)")
    parser.add_argument("--seq", type=SEQ, help=f"sequence length (default {DEFAULT_SEQ}, or "
                        "what a model's position table holds if fewer; with --calibrate, the "
                        "length the preset trains with)")
    if not planning:
        parser.add_argument("--grad-accum", type=ACCUM, default=1, metavar="N",
                            help="micro-batches the batch is split into (default 1)")
        parser.add_argument("--strategy", choices=STRATEGIES,
                            help="one strategy (default: each)")
        parser.add_argument("--ac", choices=CHECKPOINTING, default="none",
                            help="activation checkpointing (default none; selective: "
                                 "torchtitan's op policy)")
        parser.add_argument("--ac-every", type=ACCUM, default=1, metavar="N",
                            help="with --ac full: every N-th block only (default 1)")
        parser.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                            help="gradient reduction dtype (default fp32, the trainer's)")
        parser.add_argument("--fused-loss", action="store_true",
                            help="a fused cross-entropy (bf16 logits): less memory")
        parser.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash2",
                            help="flash attention's generation: flash2 (SDPA, flash-attn 2; "
                                 "default) or flash1 (FlashAttention 1, its Triton port)")
        parser.add_argument("--compile", choices=COMPILE, default="none",
                            help="what torch.compile wraps: none (default), blocks (each "
                                 "block, torchtitan's) or model (the whole model): fused "
                                 "elementwise kernels, fewer launches")
        parser.add_argument("--kernels", choices=KERNELS, default="eager",
                            help="the blocks' norms, rotary embedding and activation: eager "
                                 "(PyTorch's kernels; default) or fused (hand-written fused "
                                 "kernels: flash-attn's, xformers', Liger's), priced as "
                                 "--compile blocks prices them")
        parser.add_argument("--ep", type=EP, default=1, metavar="N",
                            help="expert parallelism: a mixture of experts' experts split "
                                 "over N ranks of each shard group, tokens sent to them by "
                                 "all-to-all (torchtitan's EP x efsdp; default 1)")
    parser.add_argument("--efficiency", type=EFFICIENCY,
                        help="one achieved fraction of peak FLOP/s for all compute "
                             "(default: the fitted compute model)")
    parser.add_argument("--intra-gbps", type=GBPS, help="NVLink GB/s per GPU (achieved)")
    parser.add_argument("--inter-gbps", type=GBPS, help="network GB/s per GPU (achieved)")
    parser.add_argument("--memory-gib", type=MEMORY_GIB,
                        help="device memory (default: the device's)")


def _shape(args: argparse.Namespace) -> tuple[ModelShape, str]:
    """(the shape --model and the shape flags describe, the ``fullshard train`` flag that
    builds it: a preset, hf:PATH, or "" when only a checkpoint of that shape would)."""
    from ..gpt import PRESET_SHAPES
    flags = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items()
             if getattr(args, flag) is not None}
    if args.mlp is not None:
        flags["gated_mlp"] = args.mlp == "swiglu"
    if args.tied is not None:
        flags["tied"] = args.tied
    if args.model in SHAPES:
        base = shape_named(args.model)
        if flags:
            return replace(base, name=f"{base.name} (modified)", **flags), ""
        return base, args.model if args.model in PRESET_SHAPES else ""
    if not os.path.exists(args.model):
        shape_named(args.model)  # E128: neither a known shape nor a path
    check_hf_model("--model", args.model)
    config = os.path.join(args.model, "config.json") if os.path.isdir(args.model) \
        else args.model
    with open(config, encoding="utf-8") as f:
        fields = {**hf_shape_fields(json.load(f), config), **flags}
    if "n_heads" in fields:
        fields.setdefault("n_kv_heads", fields["n_heads"])
    missing = [flag for flag, field in SHAPE_FLAGS.items()
               if field not in fields and field not in ("head_dim", "n_kv_heads")]
    if missing:
        raise ProjectionError(f"{config} does not give the model's {', '.join(missing)}; "
                              f"add {' '.join('--' + m.replace('_', '-') for m in missing)}")
    name = os.path.basename(os.path.dirname(os.path.abspath(config))) or config
    directory = args.model if os.path.isdir(args.model) else os.path.dirname(args.model)
    return ModelShape(name, **fields), f"hf:{directory or '.'}"


def _device(args: argparse.Namespace) -> Device:
    dev = device_named(args.gpu)
    return dev.with_overrides(
        efficiency=args.efficiency,
        memory_bytes=None if args.memory_gib is None else int(args.memory_gib * GiB),
        intra=None if args.intra_gbps is None else Link(args.intra_gbps * 1e9,
                                                        dev.intra.latency),
        inter=None if args.inter_gbps is None else Link(args.inter_gbps * 1e9,
                                                        dev.inter.latency))


def _band_note(band: ErrorBand) -> str:
    """What the ranges in the table mean (Note [leave one source out])."""
    return (f"ranges: where {band.quantile:.0%} of {band.runs} published runs fell when their "
            f"source was left out of the fit (within {band.error:.1%}; docs/projection.md)")


def _range(low: float, high: float, digits: str) -> str:
    return f"{low:{digits}}-{high:{digits}}"


def _table(rows: list, band: ErrorBand) -> str:
    head = (f"{'GPUs':>6} {'strategy':<14} {'AC':<9} {'int8':<5} {'micro':>5} {'accum':>5} "
            f"{'step s':>8} {'range':>13} {'tokens/s/GPU':>13} {'range':>15} {'MFU':>6} "
            f"{'exposed comm s':>15} {'GiB/rank':>9}  dominant")
    lines = [head]
    for p in rows:
        s = p.settings
        int8 = {"none": "-", "weights": "w", "grads": "g", "weights,grads": "w,g"}[s.quantize]
        tokens = p.tokens_per_second_per_device
        lines.append((f"{p.world_size:>6} {s.strategy:<14} {s.checkpointing:<9} {int8:<5} "
                      f"{s.batch:>5} "
                      f"{s.grad_accum:>5} {p.time.seconds:>8.3f} "
                      f"{_range(*band.seconds(p.time.seconds), '.3f'):>13} "
                      f"{tokens:>13,.0f} {_range(*band.tokens_per_second(tokens), ',.0f'):>15} "
                      f"{p.mfu:>6.1%} "
                      f"{p.time.exposed:>15.3f} {p.memory_bytes / GiB:>9.1f}  "
                      f"{p.time.dominant():<22}" + _memory_note(p)).rstrip())
    return "\n".join(lines)


def _memory_note(p) -> str:
    """Over the device's memory; or within the 10% that ``plan`` keeps free (the estimate
    counts tensors; the allocator reserves some more)."""
    if not p.fits(margin=0.0):
        return "  (over memory)"
    return "" if p.fits() else "  (tight: within 10% of memory)"


DEFAULT_SEQ = 4096


def _sequence(seq: int | None, shape, default: int = DEFAULT_SEQ, calibrating: bool = False
              ) -> int:
    """``--seq`` as given, or the default within a learned position table; a calibration
    checks a given one against the table first (its workers would fail past it), elsewhere
    the projection refuses it (E185)."""
    if shape.learned_positions:
        if seq is not None and calibrating:
            check_seq(seq, shape.learned_positions, shape.name)
        default = min(default, shape.learned_positions)
    return default if seq is None else seq


def _calibrate(args: argparse.Namespace, sizes: list[int]) -> tuple[dict[int, Device], object]:
    """Measure this machine: a plain step of the preset's GPT (in a process of its own, as
    the ranks will be), memory bandwidth, and a gloo sweep of fullshard's collectives at
    each world size asked for (ranks sharing cores slow collectives as much as compute)."""
    from ..testing import run_distributed
    from ..train.config.schema import get_preset

    cfg = get_preset(args.preset)
    args.seq = _sequence(args.seq, shape_of(cfg.gpt, args.preset), cfg.batch.seq_len,
                         calibrating=True)
    flops = run_distributed(achieved_flops, 1, cfg.gpt, args.batch, args.seq)[0]
    bandwidth = memory_bandwidth()
    devices = {}
    for ws in sizes:
        link = fit_link(run_distributed(sweep_collectives, max(2, ws))[0])
        devices[ws] = calibrated_cpu(flops, link, bandwidth)
        print(f"calibrated at {ws} rank(s): {flops / 1e9:,.2f} GFLOP/s per rank alone, "
              f"{devices[ws].cores} cores, collectives {link.bandwidth / 1e9:,.2f} GB/s and "
              f"{link.latency * 1e6:,.0f} us per ring step, memory {bandwidth / 1e9:,.1f} GB/s")
    return devices, shape_of(cfg.gpt, args.preset)


def _calibration_gpu():
    """The GPU ``--calibrate`` times a block on, or None on a machine without one."""
    return torch.device("cuda") if torch.cuda.is_available() else None


def _calibrate_gpu(args: argparse.Namespace, gpu) -> tuple[Device, ModelShape]:
    """``--gpu``'s datasheet device with the efficiency ``--model`` reaches on this GPU at
    the micro-batch and sequence asked for (Note [calibrating on one GPU])."""
    shape, _ = _shape(args)
    args.seq = _sequence(args.seq, shape)
    micro = args.batch // args.grad_accum
    device, measured = calibrate_device(_device(args), shape, micro, args.seq, gpu)
    name = torch.cuda.get_device_name(gpu) if gpu.type == "cuda" else str(gpu)
    print(f"calibrated on this GPU ({name}): one block of {shape.name} at {micro} x "
          f"{args.seq}, forward and backward, {measured['block'] * 1e3:,.2f} ms, the "
          f"embedding, head and loss {measured['rest'] * 1e3:,.2f} ms: "
          f"{measured['rate'] / 1e12:,.1f} TFLOP/s, {device.efficiency:.1%} of "
          f"{device.name}'s peak")
    return device, shape


def project_main(argv: list[str]) -> int:
    parser = OneLineParser(prog="fullshard project", description="Step time, "
                                     "tokens/s per GPU, MFU, exposed communication and memory "
                                     "per rank at cluster scale (docs/projection.md).")
    _arguments(parser, planning=False)
    parser.add_argument("--calibrate", action="store_true",
                        help="on a GPU: time --model's blocks on it and project with the "
                             "efficiency they reach (--gpu names it); on a CPU: measure this "
                             "machine (gloo) and project it, with --preset")
    parser.add_argument("--preset", default="shakespeare",
                        help="with --calibrate: the fullshard train preset to time")
    args = parser.parse_args(argv)
    try:
        sizes = _world_sizes(args.gpus)
        if args.ac_every != 1 and args.ac != "full":  # it would change nothing: say so
            raise ProjectionError(f"--ac-every {args.ac_every}: chooses every N-th block for "
                                  f"--ac full, and --ac is {args.ac}; add --ac full, or leave "
                                  "--ac-every out")
        if args.batch % args.grad_accum:
            raise ProjectionError(f"--batch {args.batch} does not split into --grad-accum "
                                  f"{args.grad_accum} micro-batches: give a multiple of "
                                  f"{args.grad_accum}")
        gpu = _calibration_gpu() if args.calibrate else None
        cpu_calibrated = args.calibrate and gpu is None
        if cpu_calibrated:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            devices, shape = _calibrate(args, sizes)
            clusters = [Cluster(devices[ws], ws, ws) for ws in sizes]  # one machine
        else:
            if gpu is not None:
                device, shape = _calibrate_gpu(args, gpu)
            else:
                device, (shape, _) = _device(args), _shape(args)
                args.seq = _sequence(args.seq, shape)
            clusters = [Cluster(device, ws, min(args.nodes_of, ws)) for ws in sizes]
        strategies = [args.strategy] if args.strategy else list(STRATEGIES)
        # a calibrated CPU trains in fp32: gathers and reductions of 4-byte values
        width = 4 if cpu_calibrated else 2
        reduce = 2 if args.reduce_dtype == "bf16" and not cpu_calibrated else 4
        rows = []
        for cluster in clusters:
            for strategy in strategies:
                if strategy == "hybrid_shard" and cluster.nodes == 1 and not args.strategy:
                    continue  # asked for by name, it is an error (E129); in the table, skipped
                if strategy == "no_shard" and args.ep > 1 and not args.strategy:
                    continue  # no shard group to split the experts over (E227 by name)
                rows.append(project(shape, cluster, Settings(
                    strategy, args.batch // args.grad_accum, args.seq, args.grad_accum,
                    args.ac, width, reduce, checkpoint_every=args.ac_every,
                    fused_loss=args.fused_loss, ep=args.ep, attention=args.attention,
                    compile=args.compile, kernels=args.kernels)))
        band = error_band()
    except (ProjectionError, ConfigError) as err:
        print(f"fullshard project: {err}", file=sys.stderr)
        return 2
    device = clusters[0].device
    micro = "" if args.grad_accum == 1 else f" in {args.grad_accum} micro-batches"
    experts = (f", {shape.active_params / 1e6:,.1f}M active: {shape.top_k} of "
               f"{shape.n_experts} experts a token" if shape.n_experts else "")
    if args.ep > 1:
        experts += f"; split over {args.ep} ranks, tokens sent by all-to-all"
    print(f"{shape.name} ({shape.num_params / 1e6:,.1f}M parameters{experts}) on {device.name}, "
          f"batch {args.batch} x {args.seq} per GPU{micro}, {device.source}")
    print(_table(rows, band))
    print(_band_note(band) + (
        "; measured on GPUs: this machine's own check is benchmarks/projection_cpu.py"
        if cpu_calibrated else "; the fitted model's: here the compute was timed on this "
        "GPU" if args.calibrate else ""))
    return 0


def plan_main(argv: list[str]) -> int:
    """``fullshard plan --gpus N``: configurations ranked by projected throughput."""
    parser = OneLineParser(prog="fullshard plan", description="Configurations that "
                                     "fit, ranked by projected tokens/s per GPU, and the "
                                     "`fullshard train` flags of the fastest.")
    _arguments(parser, planning=True)
    parser.add_argument("--allow-quantize", action="store_true", help="also rank int8 "
                        "all-gathers and reduce-scatters (--parallel.quantize weights,grads)")
    parser.add_argument("--plot", default="fullshard-plan.png", metavar="PATH",
                        help="tokens/s/GPU against world size per strategy (needs "
                             "matplotlib: pip install 'fullshard[plot]'); '' for none")
    args = parser.parse_args(argv)
    try:
        sizes = _world_sizes(args.gpus)
        if len(sizes) != 1:
            raise ProjectionError("plan takes one GPU count (--gpus 64); project takes several")
        device, (shape, model) = _device(args), _shape(args)
        args.seq = _sequence(args.seq, shape)
        gpus = sizes[0]
        cluster = Cluster(device, gpus, min(args.nodes_of, gpus))
        fits, over = rank_configurations(
            shape, cluster, batch=args.batch, seq=args.seq,
            quantize=("none", "weights,grads") if args.allow_quantize else ("none",))
        band = error_band()
    except (ProjectionError, ConfigError) as err:
        print(f"fullshard plan: {err}", file=sys.stderr)
        return 2
    print(f"{shape.name} on {gpus} x {device.name} ({cluster.nodes} node(s) of "
          f"{cluster.per_node}), {args.batch} x {args.seq} tokens per GPU per step")
    if not fits:
        print("nothing fits in {:,.0f} GiB per GPU; smallest: {:,.1f} GiB".format(
            device.memory_bytes / GiB, over[0].memory_bytes / GiB))
        return 1
    print(_table(fits[:8], band))
    print(_band_note(band))
    print()
    print(f"fullshard train {train_flags(fits[0], model or 'hf:PATH')}")
    if not model:
        print(f"  (PATH: a local Hugging Face checkpoint of the {shape.name} shape)")
    if args.plot:
        _plot(args.plot, shape, device, gpus, args)
    return 0


def _plot(path: str, shape, device: Device, gpus: int, args: argparse.Namespace) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install 'fullshard[plot]')")
        return
    sizes, n = [], min(args.nodes_of, gpus)
    while n <= gpus:
        sizes.append(n)
        n *= 2
    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy in STRATEGIES:
        xs, ys = [], []
        for ws in sizes:
            cluster = Cluster(device, ws, min(args.nodes_of, ws))
            fits, _ = rank_configurations(shape, cluster, batch=args.batch, seq=args.seq,
                                          strategies=(strategy,))
            if fits:
                xs.append(ws)
                ys.append(fits[0].tokens_per_second_per_device)
        if xs:
            ax.plot(xs, ys, marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s per GPU (best fitting configuration)")
    ax.set_title(f"{shape.name} on {device.name}, {args.batch} x {args.seq} per GPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: {path}")
