"""How the ranks come to exist and meet.

``fullshard train`` started by hand is the *launcher*: it runs ``torch.distributed.run``
in-process, which starts ``--nproc`` workers, each ``python -m fullshard.cli train`` with
the same arguments. A process started by torchrun (``LOCAL_RANK`` and ``WORLD_SIZE`` set)
is a *worker*, whoever launched it, so ``torchrun --nproc_per_node 8 -m fullshard train``
works unchanged and never launches twice.

Note [Ctrl-C]
torchrun starts workers in sessions of their own, so a terminal's Ctrl-C reaches the
launcher alone; torchrun's agent then sends SIGINT to each worker and waits
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (we default it to 300, time for a large
checkpoint) before killing them. Workers turn SIGINT/SIGTERM into a request to stop,
agree on it at the end of the step (one rank may see it a step later than another,
and a checkpoint needs them all), save, and exit 0.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

SHUTDOWN_TIMEOUT_S = "300"
# A worker's own exit codes, which the launcher passes on (any other failure: 1).
CONFIG_ERROR_EXIT = 2
DIVERGED_EXIT = 3


@dataclass(frozen=True)
class LaunchOptions:
    """Where and how many workers to start (command-line only: not part of a run's config)."""

    nproc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500
    max_restarts: int = 0


@dataclass(frozen=True)
class Worker:
    """This process's place in the job."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def is_worker() -> bool:
    """Whether torchrun (ours or someone's) started this process."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def restart_count() -> int:
    """Which attempt of the job this worker is: 0 first (and outside torchrun), then
    1, 2, ... after torchrun restarted the job (see Note [restarts] in checkpoints.py)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def job_id() -> str | None:
    """torchrun's id of the job (the same on every attempt); None outside torchrun."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


def default_nproc() -> int:
    """One rank per GPU; on CPU two ranks (sharding needs at least two to mean much)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def launch(options: LaunchOptions, worker_argv: list[str]) -> int:
    """Run ``python -m fullshard.cli train WORKER_ARGV`` on ``options.nproc`` local ranks
    (joining ``options.nnodes`` nodes) and wait for them; returns an exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    nproc = options.nproc or default_nproc()
    if not torch.cuda.is_available():
        # CPU ranks share the cores: more threads than cores per rank only contend.
        threads = max(1, (os.cpu_count() or 1) // nproc)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    if options.max_restarts > 0:
        # Restarted workers must not meet in the rendezvous store that the agent shares
        # with them: it still holds the previous attempt's gloo/NCCL addresses, and they
        # connect to dead workers (pytorch/pytorch#135712).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = ["--nproc_per_node", str(nproc), "--max-restarts", str(options.max_restarts)]
    if options.nnodes == 1 and options.master_addr is None:
        args.append("--standalone")  # a free local port, no port clashes
    else:
        args += ["--nnodes", str(options.nnodes), "--node_rank", str(options.node_rank),
                 "--master_addr", options.master_addr or "127.0.0.1",
                 "--master_port", str(options.master_port)]
    args += ["-m", "fullshard.cli", "train", *worker_argv]
    try:
        run(parse_args(args))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(f"fullshard train: rank {rank} failed with exit code {failure.exitcode} "
              "(the error is printed above)", file=sys.stderr)
        return failure.exitcode if failure.exitcode in (CONFIG_ERROR_EXIT, DIVERGED_EXIT) \
            else 1
    except SignalException as err:
        print(f"fullshard train: stopped by {signal.Signals(err.sigval).name}", file=sys.stderr)
        return 130
    return 0


def start_worker() -> Worker:
    """Join the process group: NCCL and one GPU per local rank on CUDA, gloo on CPU."""
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Worker(dist.get_rank(), dist.get_world_size(), local_rank, local_world, device)


def stop_worker() -> None:
    # Drop everything that still references the process group first: gloo can abort at
    # interpreter exit if a live object holds it (see examples/quickstart.py).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


class StopRequest:
    """Set by SIGINT/SIGTERM; see Note [Ctrl-C]."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.requested = True
