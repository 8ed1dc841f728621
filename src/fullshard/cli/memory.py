"""``fullshard estimate`` and ``fullshard plan``.

    fullshard estimate --preset llama-1b --world-size 8 --strategy full_shard --dtype bf16 \\
        --batch 4 --seq 2048 [--ac] [--offload] [--sweep]
    fullshard estimate --hf-config path/to/config.json --world-size 8 --seq 4096
    fullshard estimate --zero-table --params 7.5e9 --world-size 64
    fullshard plan --preset gpt2-124m --world-size 8 --budget-gib 24
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

import torch

from ..memory.estimate import (OPTIMIZER_STATES, STRATEGIES, estimate, estimate_traced,
                               offload_mode, trace_workload)
from ..memory.plan import plan
from ..memory.weights import QUANTIZE
from ..memory.zero_table import format_zero_table
from ..bounds import Bounds, flag_type
from ..train.config.schema import (DEFAULT_PRESET, PRESETS, ConfigError, check_optimizer,
                                   get_preset)
from ..train.config.paths import check_hf_model
from .parsing import OneLineParser, check_seq

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# The bounds of every number these commands read (checked by bounds.py).
WORLD_SIZE = flag_type(int, Bounds(1, 2 ** 16))  # beyond the largest jobs run
BATCH = flag_type(int, Bounds(1, 2 ** 20))
SEQ = flag_type(int, Bounds(1, 2 ** 24))
RESHARD_AFTER_FORWARD = flag_type(int, Bounds(1, 2 ** 20))
PARAMS = flag_type(float, Bounds(1, 1e15))
BASELINE_MIB = flag_type(float, Bounds(0, 2 ** 30))  # up to a PiB
BUDGET_GIB = flag_type(float, Bounds(0.001, 2 ** 20))  # about 1 MiB to 1 PiB
MARGIN = flag_type(float, Bounds(0, 10))
LORA_RANK = flag_type(int, Bounds(0, 2 ** 16))
EP = flag_type(int, Bounds(1, 2 ** 14))
DELAY = flag_type(int, Bounds(0, 10 ** 12))  # train's --parallel.delayed_update, on


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=list(PRESETS), help="a `fullshard train` preset "
                       "(its batch, sequence length, precision and checkpointing are the "
                       f"defaults; default {DEFAULT_PRESET})")
    model.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (or "
                       "model directory); needs transformers")
    parser.add_argument("--world-size", type=WORLD_SIZE, required=True, help="ranks training together")
    parser.add_argument("--dtype", choices=list(DTYPES), help="compute dtype (bf16/fp16: "
                        "fp32 shards, optimizer states and gradient reduction)")
    parser.add_argument("--batch", type=BATCH, help="sequences per rank per micro-batch")
    parser.add_argument("--seq", type=SEQ, help="sequence length")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda: figures compare with max_memory_allocated; cpu: with "
                        "peak RSS (gloo buffers, this process's RSS as the baseline)")
    parser.add_argument("--quantize", choices=list(QUANTIZE), help="the blocks' linear "
                        "weights in nf4 (frozen, torchao NF4; needs --lora-rank: QLoRA) or "
                        "float8 (trained, gathered in float8: torchao Float8Linear)")
    parser.add_argument("--lora-rank", type=LORA_RANK, default=0, help="LoRA adapters of "
                        "this rank on the blocks' linear layers, every other weight frozen "
                        "(fullshard train --lora.rank)")
    parser.add_argument("--int8-comm", choices=["none", "weights", "grads", "weights,grads"],
                        default="none", help="int8 all-gathers and/or reduce-scatters "
                        "(fullshard train --parallel.quantize): their buffers counted")
    parser.add_argument("--delayed-update", type=DELAY, metavar="N", help="the offloaded "
                        "blocks stepped by ZeRO-Offload's delayed update after N exact steps "
                        "(fullshard train --parallel.delayed_update N): each keeps a copy of "
                        "its shard and a second gradient buffer in host memory")
    parser.add_argument("--baseline-mib", type=BASELINE_MIB, help="process baseline to add "
                        "(default: 0 on cuda, this process's RSS on cpu)")


def _resolve(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The model source and estimate() keywords, preset values under explicit flags."""
    defaults: dict[str, Any] = {"batch": 1, "seq": None, "dtype": "fp32", "ac": False,
                                "strategy": "full_shard"}
    if args.hf_config:
        check_hf_model("--hf-config", args.hf_config)
        source = args.hf_config
    else:
        cfg = get_preset(args.preset or DEFAULT_PRESET)
        source = cfg.gpt
        defaults.update(batch=cfg.batch.batch_size, seq=cfg.batch.seq_len,
                        dtype=cfg.parallel.precision, strategy=cfg.parallel.strategy,
                        ac=cfg.parallel.activation_checkpointing)
    pick = {k: getattr(args, k, None) if getattr(args, k, None) is not None else v
            for k, v in defaults.items()}
    if not args.hf_config:
        check_seq(pick["seq"], cfg.gpt.seq_len, args.preset or DEFAULT_PRESET)
    raf = getattr(args, "reshard_after_forward", None)
    if raf is not None and args.world_size % raf:
        raise ConfigError(f"--reshard-after-forward: {raf} does not divide --world-size "
                          f"{args.world_size}; give a divisor of it")
    kwargs = {"batch_size": pick["batch"], "seq_len": pick["seq"],
              "mp_policy": DTYPES[pick["dtype"]], "optimizer": args.optimizer,
              "device": args.device, "activation_checkpointing": pick["ac"],
              "process_baseline": None if args.baseline_mib is None
              else int(args.baseline_mib * 2 ** 20),
              "quantize": args.quantize, "lora_rank": args.lora_rank,
              "quantize_comm": args.int8_comm,
              "delayed_update": args.delayed_update is not None}
    return source, kwargs, pick


def _check_delayed_update(args: argparse.Namespace, disk_flag: str | None) -> None:
    """Refuse the delayed update beside disk offload (``disk_flag`` given), as the
    library does: a unit whose states live in files is not delayed (E345)."""
    if args.delayed_update is not None and disk_flag is not None:
        raise ConfigError(f"--delayed-update: the delayed update delays the host step of "
                          f"CPU-offloaded blocks, and {disk_flag} keeps the optimizer states "
                          "in files, whose blocks are not delayed; drop one of the two")


def _check_trainable(args: argparse.Namespace, states_on_disk: bool) -> None:
    """Refuse the optimizer where `fullshard train` would (the same check)."""
    gpt = None if args.hf_config else get_preset(args.preset or DEFAULT_PRESET).gpt
    check_optimizer(args.optimizer, flag="--optimizer", states_on_disk=states_on_disk,
                    grouped_experts=gpt is not None and bool(gpt.n_experts)
                    and gpt.grouped_experts)


def _offload(text: str) -> str:
    """``--offload``'s value, as the trainer's ``--parallel.offload`` reads a fraction."""
    if text in ("none", "cpu", "disk", "disk+params"):
        return text
    if text.partition(":")[0] in ("cpu", "disk", "disk+params"):
        try:
            return offload_mode(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    raise argparse.ArgumentTypeError(f"{text!r}: expected none, cpu, disk or disk+params, "
                                     "the last three with :FRACTION for the last blocks "
                                     "only (e.g. cpu:0.5)")


def estimate_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="fullshard estimate",
                           description="Per-rank peak memory of fullshard training.")
    _model_arguments(parser)
    parser.add_argument("--strategy", choices=[s for s in STRATEGIES])
    parser.add_argument("--reshard-after-forward", type=RESHARD_AFTER_FORWARD, metavar="N",
                        help="hpZ: keep parameters sharded N ways between forward and backward")
    parser.add_argument("--ac", action=argparse.BooleanOptionalAction, default=None,
                        help="activation checkpointing of every block")
    parser.add_argument("--offload", nargs="?", const="cpu", default="none", type=_offload,
                        metavar="none|cpu|disk|disk+params[:FRACTION]", help="cpu (the "
                        "default with no value): shards, gradients and optimizer states in "
                        "host memory (CPUOffloadPolicy); disk: the optimizer states in files "
                        "(DiskOffloadPolicy); disk+params: the parameter shards too; each "
                        "with :FRACTION, the last ceil(FRACTION x blocks) blocks only "
                        "(fullshard train --parallel.offload cpu:FRACTION or "
                        "disk:PATH:FRACTION)")
    parser.add_argument("--params-on-device", action="store_true", help="with --offload "
                        "cpu or disk: each offloaded block also keeps a copy of its shard on "
                        "the device, which its gathers copy in from (fullshard train "
                        "--parallel.params_on_device true)")
    parser.add_argument("--ep", type=EP, default=1, help="expert parallelism (fullshard "
                        "train --parallel.ep): each block's experts split over N ranks, a unit "
                        "of their own sharded over world-size / N (a GPT with grouped experts: "
                        "--preset moe)")
    parser.add_argument("--sweep", action="store_true",
                        help="peak for world sizes 1, 2, 4, ... up to --world-size, each strategy")
    parser.add_argument("--zero-table", action="store_true", help="model states only, in the "
                        "ZeRO paper's accounting (2+2+12 bytes/param); needs --params")
    parser.add_argument("--params", type=PARAMS, help="parameter count for --zero-table")
    return parser


def estimate_main(argv: list[str]) -> int:
    parser = estimate_parser()
    args = parser.parse_args(argv)
    if args.zero_table:
        if args.params is None:
            parser.error("--zero-table needs --params")
        print(format_zero_table(args.params, args.world_size))
        return 0
    _check_trainable(args, states_on_disk=args.offload.startswith("disk"))
    _check_delayed_update(args, f"--offload {args.offload}"
                          if args.offload.startswith("disk") else None)
    if args.params_on_device and (args.offload == "none"
                                  or args.offload.startswith("disk+params")):
        raise ConfigError(f"--params-on-device: keeps a copy on the device of parameters "
                          f"offloaded to the host, and --offload {args.offload} "
                          + ("offloads nothing" if args.offload == "none" else
                             "pages them from files")
                          + "; give --offload cpu or disk (or their fractions)")
    source, kwargs, pick = _resolve(args)
    kwargs["offload"] = args.offload
    kwargs["params_on_device"] = args.params_on_device
    if args.sweep:
        if args.ep > 1:
            raise ConfigError(f"--ep: {args.ep} does not divide every world size --sweep "
                              "tries; estimate one --world-size with it")
        print(_sweep(source, args.world_size, kwargs))
        return 0
    with _ep_as_flag(args.ep):
        est = estimate(source, world_size=args.world_size, strategy=pick["strategy"],
                       reshard_after_forward=args.reshard_after_forward, ep=args.ep, **kwargs)
    print(est.table())
    return 0


@contextlib.contextmanager
def _ep_as_flag(ep: int):
    """The library's refusals of an expert-parallel degree as the --ep flag's usage error
    (exit 2, like every other flag), not an unexpected ValueError."""
    try:
        yield
    except ValueError as err:
        if ep == 1 or not str(err).startswith("estimate: ep"):
            raise
        raise ConfigError(f"--ep: {str(err)[len('estimate: '):]}") from None


def _sweep(source: Any, max_world: int, kwargs: dict[str, Any]) -> str:
    """Peak per rank for world sizes 1, 2, 4, ... and each strategy, from one trace."""
    sizes, n = [], 1
    while n < max_world:
        sizes.append(n)
        n *= 2
    sizes.append(max_world)
    trace_keys = ("mp_policy", "activation_checkpointing", "batch_size", "seq_len",
                  "quantize", "lora_rank")
    step = trace_workload(source, **{k: kwargs[k] for k in trace_keys})
    replay = {k: v for k, v in kwargs.items() if k not in trace_keys}
    rows = [f"{'world size':>10}  " + "  ".join(f"{s:>14}" for s in STRATEGIES)]
    for ws in sizes:
        cells = []
        for s in STRATEGIES:
            if s == "no_shard" and ws > 1 and kwargs["quantize"]:
                cells.append(f"{'-':>14}")  # quantized weights do not run on its 2-D mesh
                continue
            total = estimate_traced(step, world_size=ws, strategy=s, **replay).total
            cells.append(f"{total / 2**20:>10,.0f} MiB")
        rows.append(f"{ws:>10}  " + "  ".join(cells))
    return "peak per rank (MiB)\n" + "\n".join(rows)


def plan_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fullshard plan", description="The fastest configuration that fits a per-device "
        "memory budget, and the `fullshard train` flags that run it.")
    _model_arguments(parser)
    parser.add_argument("--budget-gib", type=BUDGET_GIB, required=True,
                        help="memory per device, GiB")
    parser.add_argument("--margin", type=MARGIN, default=0.10,
                        help="headroom over the estimate (default 0.10)")
    parser.add_argument("--allow-offload", action="store_true",
                        help="consider CPU offload: of the last k of the model's L blocks, "
                        "the smallest k that fits (fullshard train --parallel.offload "
                        "cpu:FRACTION), or of everything (cpu)")
    parser.add_argument("--host-budget-gib", type=BUDGET_GIB,
                        help="host memory per rank, GiB: offloaded plans must fit it too")
    parser.add_argument("--offload-dir", metavar="PATH", help="with --allow-offload, also "
                        "consider optimizer states in files under PATH (--parallel.offload "
                        "disk:PATH), used when the host budget rules CPU offload out")
    return parser


def plan_main(argv: list[str]) -> int:
    if any(a == "--gpus" or a.startswith("--gpus=") for a in argv):  # ranked by projection
        from .project import plan_main as projected_plan
        return projected_plan(argv)
    parser = plan_parser()
    args = parser.parse_args(argv)
    if args.offload_dir is not None and not args.allow_offload:
        parser.error("--offload-dir: offload is considered only with --allow-offload; add it")
    _check_trainable(args, states_on_disk=args.offload_dir is not None)
    _check_delayed_update(args, None if args.offload_dir is None else "--offload-dir")
    source, kwargs, pick = _resolve(args)
    del kwargs["activation_checkpointing"]
    batch, seq = kwargs.pop("batch_size"), kwargs.pop("seq_len")
    result = plan(source, world_size=args.world_size, budget_bytes=int(args.budget_gib * 2**30),
                  batch_size=batch, seq_len=seq, margin=args.margin,
                  allow_offload=args.allow_offload,
                  host_budget_bytes=(int(args.host_budget_gib * 2**30)
                                     if args.host_budget_gib is not None else None),
                  offload_dir=args.offload_dir, **kwargs)
    print(result.explain())
    if result.choice is None:
        return 1
    print()
    print(result.estimate.table())
    print()
    if args.quantize == "float8":
        print("float8 has no `fullshard train` flag: convert the model with torchao's "
              "convert_to_float8_training(..., enable_fsdp_float8_all_gather=True) in your "
              "own loop")
    folder = args.hf_config and (args.hf_config if os.path.isdir(args.hf_config)
                                 else os.path.dirname(args.hf_config) or ".")
    model = f"--model hf:{folder} " if args.hf_config \
        else f"--preset {args.preset} " if args.preset else ""
    delayed = (f" --parallel.delayed_update {args.delayed_update}"
               if args.delayed_update is not None and result.choice.offload else "")
    print(f"fullshard train {model}" + result.train_flags(pick["dtype"]) + delayed)
    return 0
