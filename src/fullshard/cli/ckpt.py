"""``fullshard ckpt``: what a checkpoint holds, and its model as one .safetensors file
or as a Hugging Face folder.

    fullshard ckpt inspect DIR          what a checkpoint holds, checksums verified
    fullshard ckpt export DIR OUT       its model as one .safetensors file (streamed)
    fullshard ckpt export DIR OUT --hf  a folder AutoModelForCausalLM.from_pretrained loads

DIR is a checkpoint, a directory whose ``latest`` names one, that ``latest`` file, or a
``fullshard train`` run's output directory (its latest checkpoint).
"""

from __future__ import annotations

import argparse
import os
import sys


DIR_HELP = ("a checkpoint, a directory whose 'latest' names one, that 'latest' file, or a "
            "fullshard train run's output directory")


def add_parser(commands) -> None:
    """Add ``ckpt`` and its subcommands to the ``fullshard`` parser's ``commands``; each
    sets ``run``, a function of the parsed arguments returning an exit code."""
    ckpt = commands.add_parser("ckpt", help="inspect or export checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = ckpt_commands.add_parser("inspect", help="what a checkpoint holds")
    inspect.add_argument("dir", help=DIR_HELP)
    inspect.add_argument("--no-verify", action="store_true", help="skip the checksums")
    inspect.set_defaults(run=_inspect)
    export = ckpt_commands.add_parser(
        "export", help="write the model to one .safetensors, or a Hugging Face folder")
    export.add_argument("dir", help=DIR_HELP)
    export.add_argument("out", help="the .safetensors file to write (with --hf: the folder)")
    export.add_argument("--hf", action="store_true",
                        help="write a Hugging Face folder (config.json, tokenizer, sharded "
                        "safetensors) of a fullshard train run's checkpoint")
    export.add_argument("--adapters", action="store_true",
                        help="a --lora.rank run: write its LoRA adapters as the folder "
                             "peft.PeftModel.from_pretrained(base, OUT) loads")
    export.add_argument("--max-shard-size", metavar="SIZE", default=None,
                        help="with --hf: the largest weights file, e.g. 500MB or 2GiB "
                        "(default 5GB)")
    export.set_defaults(run=_export)


def _inspect(args: argparse.Namespace) -> int:
    from ..checkpoint.export import inspect
    from ..train.checkpoints import resolve_checkpoint

    info = inspect(resolve_checkpoint(args.dir), verify=not args.no_verify)
    print(f"checkpoint   {info['path']}")
    if info["world_size"] is not None:  # None: torch's DCP wrote it, no manifest says
        print(f"saved at     world size {info['world_size']}, "
              f"{'with' if info['has_optimizer'] else 'without'} optimizer state")
    said = " (--no-verify)" if args.no_verify else ""
    print(f"files        {info['bytes'] / 2**20:.1f} MiB, checksums: {info['checksums']}{said}")
    extra = info["extra"]
    if isinstance(extra, dict):
        shown = {k: v for k, v in extra.items() if isinstance(v, (int, float, str, bool))}
        print(f"extra        {shown}" + (" (+ more)" if len(shown) < len(extra) else ""))
    total = sum(t["bytes"] for t in info["tensors"].values())
    print(f"model        {len(info['tensors'])} tensors, "
          f"{sum(t['numel'] for t in info['tensors'].values()):,} elements, "
          f"{total / 2**20:.1f} MiB")
    width = max((len(n) for n in info["tensors"]), default=4)
    for name, t in info["tensors"].items():
        print(f"  {name:<{width}}  {str(tuple(t['shape'])):<16} {t['dtype']:<9} {t['bytes']:>12,} B")
    if info["failed"]:  # said last, where it is read, and on stderr for scripts
        source = "its metadata" if info["world_size"] is None else "its manifest"
        print(f"fullshard ckpt: {info['path']} failed verification: the table above is from "
              f"{source}, and its files are damaged; do not load it (an earlier "
              "checkpoint, or a copy, may be intact)", file=sys.stderr)
        return 1
    return 0


def _export(args: argparse.Namespace) -> int:
    from ..checkpoint.export import export_safetensors
    from ..train.checkpoints import resolve_checkpoint
    from ..train.config.schema import ConfigError

    if args.adapters:
        if args.hf or args.max_shard_size is not None:
            raise ConfigError("--adapters: writes the adapters alone, in one file; leave "
                              "out --hf and --max-shard-size (they export the whole model)")
        from ..train.export.adapters import export_adapters
        for path in export_adapters(args.dir, args.out):
            print(path)
        return 0
    if not args.hf:
        if args.max_shard_size is not None:
            raise ConfigError("--max-shard-size: applies to --hf exports only; add --hf, "
                              "or leave it out for one .safetensors file")
        if os.path.isdir(args.out):  # the one file would be renamed over the directory
            out = os.path.abspath(args.out)
            raise ConfigError(f"{out} is a directory, and an export without --hf writes one "
                              f".safetensors file; name a file (such as {out}/model.safetensors)"
                              ", or add --hf to write a Hugging Face folder into it")
        print(export_safetensors(resolve_checkpoint(args.dir), args.out))
        return 0
    from ..train.export.hf import DEFAULT_MAX_SHARD_SIZE, export_hf, parse_size

    size = parse_size(args.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    for path in export_hf(args.dir, args.out, size):
        print(path)
    return 0
