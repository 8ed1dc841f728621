"""``fullshard train``: train a model, sharded over local (or several nodes') ranks.

    fullshard train                                   the default: GPT on Tiny Shakespeare
    fullshard train --preset debug --steps 40 --out runs/d
    fullshard train --steps 60 --out runs/d --resume  continue to step 60
    fullshard train --model hf:./my-llama --data notes.jsonl --parallel.precision bf16
    fullshard train --max-restarts 3                  restart failed workers from the
                                                      latest checkpoint, up to 3 times

Without torchrun's environment it launches ``--nproc`` workers itself (2 on CPU, one
per GPU); under ``torchrun ... -m fullshard train`` (or any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT) each process is a worker. Several nodes: the
same command on each with ``--nnodes N --node-rank K --master-addr NODE0``, or under
``srun --ntasks-per-node=1`` with no launch flag (docs/multinode.md).
Configuration: a preset, then ``--config FILE.toml``, then ``--section.field VALUE``
flags, each applied over the one before (on ``--resume``, OUT/config.toml replaces the
preset).

Exit codes: 0 done (or stopped on request, saved), 1 an error no check foresaw (one
line naming it; FULLSHARD_TRACEBACK=1 adds the traceback), 2 a configuration error, 3
the loss or gradient norm stopped being finite (nothing saved after the last good
checkpoint); the launcher passes those on, and returns 1 when a worker failed otherwise,
130 when stopped by a signal.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..core.comm import CollectiveError
from ..train.launch.agreement import check_same_run
from ..train.checkpoints import (STEP_DIR, checkpoint_dir, divergence_of_this_job, hold_run,
                                 resumes_after_restart)
from ..train.newest_step import point_latest_at_newest
from ..train.launch.cluster import check_worker_environment, local_place
from ..train.config.schema import (DEFAULT_PRESET, GPU_PRESETS, PRESETS, ConfigError, TrainConfig,
                                   get_preset, validate)
from ..train.data import BUILTIN
from ..train.config.flags import help_text, load_toml, parse_flags
from ..train.launch.launcher import (CONFIG_ERROR_EXIT, DIVERGED_EXIT, LaunchOptions,
                                     agree_on_attempt, is_worker, launch, record_worker_exit,
                                     start_worker, stop_worker)
from ..train.config.packages import check_packages
from ..train.config.paths import check_hf_model, check_output_dir, check_text_file
from . import launch_flags
from .parsing import OneLineParser


class _RunParser(OneLineParser):
    """The run flags; every other flag is a config field's, kept in ``args.fields`` for
    tyro (train/config/flags.py), which also writes their part of ``--help``."""

    def parse_args(self, args=None, namespace=None):
        known, fields = self.parse_known_args(args, namespace)
        known.fields = fields
        return known

    def format_help(self) -> str:
        return (super().format_help() + "\nconfiguration fields (defaults: the "
                f"{DEFAULT_PRESET} preset):\n" + help_text())


def build_parser() -> argparse.ArgumentParser:
    """The run's flags; the launch flags are listed too (for --help) but read first, on
    their own (launch_flags.split)."""
    parser = _RunParser(
        prog=launch_flags.PROG, description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n\n")[1:]), allow_abbrev=False,
        parents=[launch_flags.parser()])
    run = parser.add_argument_group("run")
    run.add_argument("--preset", default=None, choices=list(PRESETS),
                     help=f"named configuration to start from (default {DEFAULT_PRESET})")
    run.add_argument("--config", metavar="FILE.toml", help="TOML applied over the preset")
    run.add_argument("--out", metavar="DIR", help="where metrics, plot, config and "
                     "checkpoints go (default runs/PRESET)")
    run.add_argument("--resume", action="store_true",
                     help="continue from the latest checkpoint in --out")
    return parser


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, str]:
    """The run's config and output directory from parsed flags (see the module doc)."""
    preset = args.preset or DEFAULT_PRESET
    out = args.out or os.path.join("runs", preset)
    check_output_dir("--out", out)
    cfg = get_preset(preset)
    saved = os.path.join(out, "config.toml")
    resuming = args.resume and os.path.isfile(saved)
    if resuming:
        cfg = load_toml(cfg, saved)
    cfg = _apply_config_and_flags(cfg, args)
    if resuming and args.preset is not None:
        # The run's own config replaces the preset: a --preset whose model differs would
        # be silently ignored. "The same command plus --resume" resumes: the preset is
        # compared as that command configures it (--model hf:..., --gpt.* flags applied).
        named = _apply_config_and_flags(get_preset(args.preset), args)
        if _model_of(named) != _model_of(cfg):
            raise ConfigError(f"--preset {args.preset}: --resume continues the model of "
                              f"{saved}, not that preset's; leave out --preset to resume "
                              "it, or give another --out to train the preset")
    if cfg.optim.decay_steps == 0:  # fixed now, and saved in config.toml for --resume
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                 decay_steps=cfg.steps))
    validate(cfg)
    if cfg.is_hf:
        check_hf_model("model", cfg.hf_path)
    elif cfg.data not in BUILTIN:
        check_text_file("data", cfg.data)
    return check_packages(cfg), out


def _apply_config_and_flags(cfg: TrainConfig, args: argparse.Namespace) -> TrainConfig:
    if args.config:
        cfg = load_toml(cfg, args.config)
    return parse_flags(cfg, args.fields)


def _model_of(cfg: TrainConfig) -> tuple:
    """What decides the model a run trains (a Hugging Face folder's own config decides
    its shape; the preset's GPT shape then plays no part)."""
    return (cfg.model, None if cfg.is_hf else cfg.gpt)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    launch_given, run_argv = launch_flags.split(argv)
    args = build_parser().parse_args(run_argv)
    try:
        cfg, out = resolve_config(args)
        _check_launch(args, out)
        if not is_worker():
            options = launch_flags.launch_options(launch_given, os.environ)
            if args.preset in GPU_PRESETS:
                _print_expected_memory(cfg, args.preset, options)
            return launch(options, run_argv)
    except ConfigError as err:
        print(f"fullshard train: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        code = _work(cfg, out, args.resume)
    except Exception:
        record_worker_exit(1)  # its traceback follows
        raise
    record_worker_exit(code)
    return code


def _check_launch(args: argparse.Namespace, out: str) -> None:
    if args.resume:
        said = point_latest_at_newest(checkpoint_dir(out), STEP_DIR)
        if said is not None:
            print(f"fullshard train: {said}", file=sys.stderr, flush=True)


def _print_expected_memory(cfg: TrainConfig, preset: str, options: LaunchOptions) -> None:
    import torch

    from ..train.launch.launcher import default_nproc
    from ..train.report.metrics import expected_memory_line

    world = (options.nproc or default_nproc()) * options.nnodes
    line = expected_memory_line(cfg, preset, world,
                                "cuda" if torch.cuda.is_available() else "cpu")
    if line is not None:
        print(f"fullshard train: {line}", file=sys.stderr, flush=True)


def _work(cfg: TrainConfig, out: str, resume: bool) -> int:
    from ..train.loop import Diverged, Trainer  # the launcher never needs the training stack

    # Errors are printed once per node (each node's launcher shows its own workers').
    first_on_node = local_place(os.environ)[0] == 0
    try:
        check_worker_environment(os.environ)
    except ConfigError as err:
        if first_on_node:
            print(f"fullshard train: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    worker = start_worker(offload=cfg.parallel.offload != "none")
    try:
        agree_on_attempt()  # Note [restarts across nodes]
        check_same_run(cfg, resume)
        hold_run(out)  # one job writes a run directory at a time
        diverged_before = divergence_of_this_job(out)
        if diverged_before is not None:  # a restart would only diverge again: Note [restarts]
            raise Diverged(diverged_before)
        resume = resume or resumes_after_restart(out)
        Trainer(cfg, out, worker).run(resume)
    except ConfigError as err:
        if first_on_node:
            print(f"fullshard train: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except Diverged as err:
        if first_on_node:
            print(f"fullshard train: {err}", file=sys.stderr)
        return DIVERGED_EXIT
    except CollectiveError as err:  # a peer went away: the rank that failed is elsewhere
        print(err, file=sys.stderr)
        return 1
    finally:
        stop_worker()
    return 0
