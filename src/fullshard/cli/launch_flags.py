"""``fullshard train``'s launch flags: where and how many ranks to start.

They are read first, on their own, and taken out of the command line: what is left goes
to the run's configuration flags and, unchanged, to every worker. So workers never see
them (a worker does not launch), and neither does torchrun's parser (which would take
``--nproc`` for an ambiguous abbreviation of its ``--nproc-per-node``). Inside a Slurm
step, Slurm's variables supply the defaults (train/launch/cluster.py); a flag given wins.
"""

from __future__ import annotations

import argparse
from typing import Mapping

from ..bounds import Bounds, flag_type
from ..train.launch.cluster import slurm_launch_settings
from ..train.launch.launcher import DEFAULT_JOIN_TIMEOUT_S, DEFAULT_MASTER_PORT, LaunchOptions
from .parsing import OneLineParser

PROG = "fullshard train"
# The bounds of the numeric launch flags (bounds.py); LaunchOptions.check then
# checks what Slurm supplied and the rules between flags (--node-rank below --nnodes).
NPROC = flag_type(int, Bounds(1, 2 ** 12))
NNODES = flag_type(int, Bounds(1, 2 ** 16))
NODE_RANK = flag_type(int, Bounds(0, 2 ** 16 - 1))
PORT = flag_type(int, Bounds(1, 65535))
JOIN_TIMEOUT_S = flag_type(int, Bounds(1, 7 * 24 * 3600))
MAX_RESTARTS = flag_type(int, Bounds(0, 10 ** 6))


def parser() -> argparse.ArgumentParser:
    """The launch flags alone (no --help: `fullshard train --help` lists them)."""
    flags = OneLineParser(prog=PROG, add_help=False, allow_abbrev=False)
    # Defaults are None so that Slurm's settings show through where no flag is given.
    where = flags.add_argument_group(
        "launch (ignored in a worker: under torchrun, or where RANK and WORLD_SIZE are set)")
    where.add_argument("--nproc", type=NPROC, help="ranks on this node (default: one per GPU, "
                       "2 on CPU)")
    where.add_argument("--nnodes", type=NNODES, help="nodes in the job (default 1; under "
                       "srun: the step's nodes)")
    where.add_argument("--node-rank", type=NODE_RANK, help="this node's index: node 0 hosts the "
                       "rendezvous (default 0; under srun: SLURM_NODEID)")
    where.add_argument("--master-addr", help="address of node 0 (multi-node; under srun: "
                       "the step's first node)")
    where.add_argument("--master-port", type=PORT,
                       help=f"port of the rendezvous on node 0 (default {DEFAULT_MASTER_PORT})")
    where.add_argument("--join-timeout", type=JOIN_TIMEOUT_S, metavar="SECONDS",
                       help="how long nodes wait for each other at the start and after a "
                       f"restart before giving up (default {DEFAULT_JOIN_TIMEOUT_S})")
    where.add_argument("--max-restarts", type=MAX_RESTARTS, metavar="N",
                       help="when a worker fails, restart all of them (on every node) from "
                       "the latest checkpoint, up to N times (default 0)")
    return flags


def split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the launch flags given, the rest of ``argv`` in its order). Exits 2 with one
    line on a malformed launch flag."""
    return parser().parse_known_args(argv)


def launch_options(given: argparse.Namespace, env: Mapping[str, str]) -> LaunchOptions:
    """The flags given over Slurm's settings over the defaults, checked (ConfigError)."""
    settings = slurm_launch_settings(env)
    settings.update({name: value for name, value in vars(given).items() if value is not None})
    options = LaunchOptions(**settings)
    options.check()
    return options
