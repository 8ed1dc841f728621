"""The ``fullshard`` command.

    fullshard train [FLAGS]             train a model (the default: a small GPT on Tiny Shakespeare)
    fullshard estimate [FLAGS]          per-rank memory estimate for a model and configuration
    fullshard plan [FLAGS]              the fastest configuration that fits a memory budget
    fullshard plan --gpus N [FLAGS]     configurations ranked by projected tokens/s at scale
    fullshard project [FLAGS]           step time, tokens/s, MFU, communication at 8-1024 GPUs
    fullshard ckpt inspect DIR          what a checkpoint holds, checksums verified
    fullshard ckpt export DIR OUT       its model as one .safetensors file (streamed)
    fullshard ckpt export DIR OUT --hf  its model as a Hugging Face folder (streamed)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import NoReturn

from . import ckpt
from .parsing import OneLineParser

# Commands that parse their own flags live in their own modules ("module:function", each
# taking the remaining argv and returning an exit code); they are imported only when used so
# that `fullshard ckpt ...` does not pay for the trainer's imports.
DELEGATED_COMMANDS = {
    "train": "fullshard.cli.train:main",
    "estimate": "fullshard.cli.memory:estimate_main",
    "plan": "fullshard.cli.memory:plan_main",
    "project": "fullshard.cli.project:project_main",
}
# Set to 1 to see the traceback of an error the command line reports in one line.
TRACEBACK_VARIABLE = "FULLSHARD_TRACEBACK"
USAGE_EXIT, RUNTIME_EXIT = 2, 1


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="fullshard", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in DELEGATED_COMMANDS:  # listed in --help; their flags: `fullshard NAME --help`
        commands.add_parser(name, help=f"see `fullshard {name} --help`")
    ckpt.add_parser(commands)
    return parser


def entry() -> NoReturn:
    """The ``fullshard`` program: ``main``, then the process's end (a worker of a job ends
    as Note [a worker's process ends without the interpreter's finalization] says)."""
    code = main()
    # Only a command that joined a job imported the launcher; others never import torch here.
    launcher = sys.modules.get("fullshard.train.launch.launcher")
    if launcher is not None and launcher.joined_as_worker():
        launcher.end_worker_process(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Whatever escapes it is one line on stderr naming the cause: exit
    code 2 for a value, flag or file given wrong (ConfigError, CheckpointError), 1 for
    anything else; the traceback too with FULLSHARD_TRACEBACK=1."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "fullshard" + (f" {argv[0]}" if argv and not argv[0].startswith("-") else "")
    try:
        return _run(argv)
    except Exception as err:  # noqa: BLE001 - every error leaves as one line, by design
        if _wants_traceback():
            traceback.print_exc()
        print(f"{command}: {_describe(err)}", file=sys.stderr, flush=True)
        return USAGE_EXIT if _is_usage_error(err) else RUNTIME_EXIT


def _run(argv: list[str]) -> int:
    if argv and argv[0] in DELEGATED_COMMANDS:
        module_name, function_name = DELEGATED_COMMANDS[argv[0]].split(":")
        return getattr(importlib.import_module(module_name), function_name)(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)


def _is_usage_error(err: Exception) -> bool:
    from ..checkpoint import CheckpointError
    from ..errors import ConfigError

    return isinstance(err, (ConfigError, CheckpointError))


def _describe(err: Exception) -> str:
    """The error's message as one line: a ConfigError's or CheckpointError's alone (it
    names the flag, field or file), any other's after its type."""
    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if _is_usage_error(err):
        return message
    hint = "" if _wants_traceback() else f" (set {TRACEBACK_VARIABLE}=1 for the traceback)"
    return f"{type(err).__name__}: {message or 'no message'}{hint}"


def _wants_traceback() -> bool:
    return os.environ.get(TRACEBACK_VARIABLE, "0") not in ("", "0")
