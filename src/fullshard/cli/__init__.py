"""The ``fullshard`` command.

    fullshard train [FLAGS]             train a model (the default: a small GPT on Tiny Shakespeare)
    fullshard estimate [FLAGS]          per-rank memory estimate for a model and configuration
    fullshard plan [FLAGS]              the fastest configuration that fits a memory budget
    fullshard ckpt inspect DIR          what a checkpoint holds, checksums verified
    fullshard ckpt export DIR OUT       its model as one .safetensors file (streamed)
    fullshard ckpt export DIR OUT --hf  its model as a Hugging Face folder (streamed)
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import ckpt

# Commands that parse their own flags live in their own modules ("module:function", each
# taking the remaining argv and returning an exit code); they are imported only when used so
# that `fullshard ckpt ...` does not pay for the trainer's imports.
DELEGATED_COMMANDS = {
    "train": "fullshard.cli.train:main",
    "estimate": "fullshard.cli.memory:estimate_main",
    "plan": "fullshard.cli.memory:plan_main",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fullshard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in DELEGATED_COMMANDS:  # listed in --help; their flags: `fullshard NAME --help`
        commands.add_parser(name, help=f"see `fullshard {name} --help`")
    ckpt.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED_COMMANDS:
        module_name, function_name = DELEGATED_COMMANDS[argv[0]].split(":")
        return getattr(importlib.import_module(module_name), function_name)(argv[1:])
    args = build_parser().parse_args(argv)
    from ..checkpoint import CheckpointError
    from ..train.config import ConfigError

    try:
        return args.run(args)
    except (CheckpointError, ConfigError) as err:
        print(f"fullshard: {err}", file=sys.stderr)
        return 2
