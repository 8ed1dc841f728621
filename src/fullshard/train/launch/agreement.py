"""What every rank of a job must share before it trains: the configuration, the launch
flags that shape the job, and the versions of fullshard and torch.

Each node's launcher reads its own command line and config file, and nothing in
torchrun compares them: ranks that build different models or train for a different
number of steps would hang in a collective or silently train something else. Right
after joining the process group every rank sends what it is about to run to every
other; any difference is a one-line error on every node naming the field and which
ranks hold which value. ``--out`` is not compared (nodes may mount one shared directory
at different paths); ``checkpoints.check_shared`` checks that it is shared.
"""

from __future__ import annotations

import os
from importlib import metadata

import torch
import torch.distributed as dist

from ..config.schema import ConfigError, TrainConfig, scalar_fields, sections
from .launcher import LAUNCH_VARIABLE

# Differences named in full in the error; more are counted.
SHOWN_DIFFERENCES = 3


def run_description(cfg: TrainConfig, resume: bool) -> dict[str, str]:
    """What this rank is about to run, as names a person would write -> values."""
    description = {f"{prefix}{f.name}": repr(getattr(obj, f.name))
                   for prefix, obj in sections(cfg) for f in scalar_fields(obj)}
    description["--resume"] = repr(resume)
    # The launcher's flags ("--nnodes=2 --nproc=2 ..."; absent under another launcher).
    for item in os.environ.get(LAUNCH_VARIABLE, "").split():
        flag, _, value = item.partition("=")
        description[flag] = value
    description["torch version"] = torch.__version__
    description["fullshard version"] = _fullshard_version()
    return description


def _fullshard_version() -> str:
    try:
        return metadata.version("fullshard")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "(not installed)"


def check_same_run(cfg: TrainConfig, resume: bool) -> None:
    """Collective: raise ConfigError on every rank if any two ranks would run differently."""
    node = int(os.environ.get("GROUP_RANK", dist.get_rank()))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (node, run_description(cfg, resume)))
    nodes = [n for n, _ in everyone]
    differences = []
    for key in set().union(*(d for _, d in everyone)):
        values = [d.get(key, "(none)") for _, d in everyone]
        if len(set(values)) > 1:
            differences.append(_describe(key, values, nodes))
    if not differences:
        return
    differences.sort()
    shown = "; ".join(differences[:SHOWN_DIFFERENCES])
    more = len(differences) - SHOWN_DIFFERENCES
    raise ConfigError(
        f"the nodes disagree: {shown}{f'; and {more} more' if more > 0 else ''}; run the "
        "same command, config file and versions on every node")


def _describe(key: str, values: list[str], nodes: list[int]) -> str:
    """``steps: 6 on node 0 (ranks 0-1), 9 on node 1 (ranks 2-3)``."""
    holders: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        holders.setdefault(value, []).append(rank)
    parts = []
    for value, ranks in holders.items():
        where = sorted({nodes[r] for r in ranks})
        parts.append(f"{value} on {counted('node', where)} ({counted('rank', ranks)})")
    return f"{key}: {', '.join(parts)}"


def counted(noun: str, numbers: list[int]) -> str:
    """("rank", [2, 3]) -> "ranks 2-3"; ("rank", [1]) -> "rank 1"."""
    return f"{noun}{'s' if len(numbers) > 1 else ''} {spans(numbers)}"


def spans(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
