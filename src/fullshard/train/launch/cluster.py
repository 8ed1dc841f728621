"""What the machine and a cluster scheduler tell a process about the job it is part of.

Slurm: ``srun`` runs one task per node (``--ntasks-per-node=1``), and each task's
``fullshard train`` is its node's launcher. It reads the job step's node count
(``SLURM_STEP_NUM_NODES``), its node's index in the step (``SLURM_NODEID``), the first node
of ``SLURM_STEP_NODELIST`` (the master address: node 0 hosts the rendezvous) and the job
and step ids (the rendezvous' name); launch flags given on the command line win.

Any launcher that sets torch.distributed's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``; a Kubernetes PyTorchJob sets them in every pod) makes
each process one rank: the process is a worker, one per node unless ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` say otherwise.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from ..config.schema import ConfigError

# One name of a Slurm hostlist: text with bracketed ranges, e.g. "gpu[01-03,7]-ib".
_BRACKET = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list as names, in order: ``"a[1-2],b[08-09]c"`` ->
    ``["a1", "a2", "b08c", "b09c"]`` (what ``scontrol show hostnames`` prints)."""
    names = []
    for item in _split_outside_brackets(hostlist):
        names += _expand_one(item)
    return names


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return [item for item in [*items, current] if item]


def _expand_one(name: str) -> list[str]:
    found = _BRACKET.search(name)
    if found is None:
        return [name]
    head, tail = name[:found.start()], name[found.end():]
    names = []
    for part in found[1].split(","):
        first, _, last = part.partition("-")
        width = len(first)  # "08-10" keeps its zero padding
        for number in range(int(first), int(last or first) + 1):
            names += [f"{head}{number:0{width}d}{rest}" for rest in _expand_one(tail)]
    return names


def slurm_launch_settings(env: Mapping[str, str]) -> dict:
    """Inside an ``srun`` step: the launch settings Slurm implies (LaunchOptions
    fields); outside one: ``{}``."""
    if "SLURM_STEP_NUM_NODES" not in env:
        return {}
    nodes, tasks = int(env["SLURM_STEP_NUM_NODES"]), int(env["SLURM_STEP_NUM_TASKS"])
    if tasks != nodes:
        raise ConfigError(
            f"srun: {tasks} tasks on {nodes} nodes; fullshard train starts the ranks of "
            "its node itself: run one task per node (srun --ntasks-per-node=1) and set "
            "--nproc to the ranks per node")
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    return {"nnodes": nodes, "node_rank": int(env["SLURM_NODEID"]),
            "master_addr": expand_hostlist(env["SLURM_STEP_NODELIST"])[0],
            "rdzv_id": f"slurm-{env['SLURM_JOB_ID']}.{step}"}


def local_place(env: Mapping[str, str]) -> tuple[int, int]:
    """A worker's (local rank, ranks on its node). torchrun sets both; a launcher that
    sets only RANK and WORLD_SIZE starts one process per node (a PyTorchJob's pod)."""
    if "LOCAL_RANK" not in env:
        return 0, 1
    return int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))


def check_worker_environment(env: Mapping[str, str]) -> None:
    """A worker's environment is complete and fits the machine (ConfigError if not)."""
    if "LOCAL_RANK" not in env:  # not torchrun's: torch.distributed's env:// variables
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise ConfigError(
                    f"{name}: RANK and WORLD_SIZE are set, so this process is one rank of "
                    f"a job another launcher started, but {name} is not; set MASTER_ADDR "
                    "and MASTER_PORT (where rank 0 listens), or unset RANK and WORLD_SIZE "
                    "to let fullshard train launch its ranks")
        # A PyTorchJob's WORLD_SIZE counts nprocPerNode ranks per pod when it is a number
        # (for torchrun to start), one per pod otherwise ("auto").
        per_pod = env.get("PET_NPROC_PER_NODE", "1")
        if per_pod.isdigit() and int(per_pod) > 1:
            raise ConfigError(
                f"PET_NPROC_PER_NODE={per_pod}: this pod was meant to start {per_pod} ranks "
                "(a PyTorchJob's nprocPerNode), but its WORLD_SIZE and RANK count one "
                "process per pod; set nprocPerNode: \"1\" (one rank per pod), or run "
                "`torchrun -m fullshard train` in the container")
    check_gpus(local_place(env)[1], "LOCAL_WORLD_SIZE (torchrun --nproc-per-node)")


def check_gpus(ranks: int, asked_by: str) -> None:
    """NCCL needs a GPU of its own for each rank of a node (two ranks on one GPU die with
    "Duplicate GPU detected"): refuse more ranks than visible GPUs."""
    if torch.cuda.is_available() and ranks > torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ConfigError(
            f"{asked_by}: {ranks} ranks on this node, but it has {count} visible GPU"
            f"{'s' if count != 1 else ''} and NCCL needs one per rank; ask for {count} or "
            "fewer (or make more GPUs visible: CUDA_VISIBLE_DEVICES)")
