"""The ``fullshard`` command.

    fullshard train [FLAGS]             train a model (the default: a small GPT on Tiny Shakespeare)
    fullshard estimate [FLAGS]          per-rank memory estimate for a model and configuration
    fullshard plan [FLAGS]              the fastest configuration that fits a memory budget
    fullshard ckpt inspect DIR          what a checkpoint holds, checksums verified
    fullshard ckpt export DIR OUT       its model as one .safetensors file (streamed)
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Commands that parse their own flags live in their own modules ("module:function", each
# taking the remaining argv and returning an exit code); they are imported only when used so
# that `fullshard ckpt ...` does not pay for the trainer's imports.
DELEGATED_COMMANDS = {
    "train": "fullshard.train.cli:main",
    "estimate": "fullshard.memory.cli:estimate_main",
    "plan": "fullshard.memory.cli:plan_main",
}


def _ckpt_inspect(args: argparse.Namespace) -> int:
    from .checkpoint.export import inspect

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


def _ckpt_export(args: argparse.Namespace) -> int:
    from .checkpoint.export import export_safetensors

    print(export_safetensors(args.dir, args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fullshard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in DELEGATED_COMMANDS:  # listed in --help; their flags: `fullshard NAME --help`
        commands.add_parser(name, help=f"see `fullshard {name} --help`")
    ckpt = commands.add_parser("ckpt", help="inspect or export checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = ckpt_commands.add_parser("inspect", help="what a checkpoint holds")
    inspect.add_argument("dir", help="a checkpoint, or a directory whose 'latest' names one")
    inspect.add_argument("--no-verify", action="store_true", help="skip the checksums")
    inspect.set_defaults(run=_ckpt_inspect)
    export = ckpt_commands.add_parser("export", help="write the model to one .safetensors")
    export.add_argument("dir", help="a checkpoint, or a directory whose 'latest' names one")
    export.add_argument("out", help="the .safetensors file to write")
    export.set_defaults(run=_ckpt_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED_COMMANDS:
        module_name, function_name = DELEGATED_COMMANDS[argv[0]].split(":")
        return getattr(importlib.import_module(module_name), function_name)(argv[1:])
    args = build_parser().parse_args(argv)
    from .checkpoint import CheckpointError

    try:
        return args.run(args)
    except CheckpointError as err:
        print(f"fullshard: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
