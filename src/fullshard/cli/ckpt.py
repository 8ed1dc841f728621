"""``fullshard ckpt``: what a checkpoint holds, and its model as one .safetensors file.

    fullshard ckpt inspect DIR          what a checkpoint holds, checksums verified
    fullshard ckpt export DIR OUT       its model as one .safetensors file (streamed)
"""

from __future__ import annotations

import argparse


def add_parser(commands) -> None:
    """Add ``ckpt`` and its subcommands to the ``fullshard`` parser's ``commands``; each
    sets ``run``, a function of the parsed arguments returning an exit code."""
    ckpt = commands.add_parser("ckpt", help="inspect or export checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = ckpt_commands.add_parser("inspect", help="what a checkpoint holds")
    inspect.add_argument("dir", help="a checkpoint, or a directory whose 'latest' names one")
    inspect.add_argument("--no-verify", action="store_true", help="skip the checksums")
    inspect.set_defaults(run=_inspect)
    export = ckpt_commands.add_parser("export", help="write the model to one .safetensors")
    export.add_argument("dir", help="a checkpoint, or a directory whose 'latest' names one")
    export.add_argument("out", help="the .safetensors file to write")
    export.set_defaults(run=_export)


def _inspect(args: argparse.Namespace) -> int:
    from ..checkpoint.export import inspect

    info = inspect(args.dir, verify=not args.no_verify)
    print(f"checkpoint   {info['path']}")
    print(f"saved at     world size {info['world_size']}, "
          f"{'with' if info['has_optimizer'] else 'without'} optimizer state")
    print(f"files        {info['bytes'] / 2**20:.1f} MiB, checksums: {info['checksums']}")
    extra = info["extra"]
    if isinstance(extra, dict):
        shown = {k: v for k, v in extra.items() if isinstance(v, (int, float, str, bool))}
        print(f"extra        {shown}" + (" (+ more)" if len(shown) < len(extra) else ""))
    total = sum(t["bytes"] for t in info["tensors"].values())
    print(f"model        {len(info['tensors'])} tensors, "
          f"{sum(_numel(t['shape']) for t in info['tensors'].values()):,} elements, "
          f"{total / 2**20:.1f} MiB")
    width = max((len(n) for n in info["tensors"]), default=4)
    for name, t in info["tensors"].items():
        print(f"  {name:<{width}}  {str(tuple(t['shape'])):<16} {t['dtype']:<9} {t['bytes']:>12,} B")
    return 0 if info["checksums"] in ("ok", "not checked") else 1


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _export(args: argparse.Namespace) -> int:
    from ..checkpoint.export import export_safetensors

    print(export_safetensors(args.dir, args.out))
    return 0
