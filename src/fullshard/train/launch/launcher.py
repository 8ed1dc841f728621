"""How the ranks come to exist and meet.

``fullshard train`` started by hand is the *launcher*: it runs ``torch.distributed.run``
in-process, which starts ``--nproc`` workers, each ``python -m fullshard.cli train`` with
the same arguments but the launch flags. A process whose environment already places it
in a job is a *worker*, whoever launched it: torchrun's (``LOCAL_RANK`` and
``WORLD_SIZE``), or that of any launcher that sets torch.distributed's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: a Kubernetes PyTorchJob), so
``torchrun --nproc_per_node 8 -m fullshard train`` works unchanged and never launches twice.

Several nodes meet in torchrun's c10d rendezvous at ``--master-addr:--master-port``, which
node 0's launcher hosts: each launcher waits up to ``--join-timeout`` seconds for the
others (at the start and after a restart), so a node that never comes is an error, not a
hang. The rendezvous numbers the nodes itself (by host name), so ``--node-rank`` says only
which node hosts it. Ranks are contiguous per node: node k holds ranks
``k*nproc ... (k+1)*nproc - 1``.

Note [Ctrl-C]
torchrun starts workers in sessions of their own, so a terminal's Ctrl-C reaches the
launcher alone; torchrun's agent then sends SIGINT to each worker and waits
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (we default it to 300, time for a large
checkpoint) before killing them. Workers turn SIGINT/SIGTERM into a request to stop,
agree on it at the end of the step (one rank may see it a step later than another,
and a checkpoint needs them all), save, and exit 0.

Note [restarts across nodes]
torchrun's agents restart their node's workers on their own: the node where a worker
died counts an attempt (TORCHELASTIC_RESTART_COUNT), but another node may restart
because a new round of the rendezvous began, which torchrun does not count. So the
workers agree right after joining the process group: the job's attempt is the largest
count over ranks, and the job is rank 0's launcher's (each launcher draws an id that
its workers keep across restarts; workers of another launcher use TORCHELASTIC_RUN_ID).
``restart_count`` and ``job_id`` answer with the agreed values from then on.
"""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from .cluster import check_gpus, local_place
from ..config.schema import ConfigError

SHUTDOWN_TIMEOUT_S = "300"
# A worker's own exit codes, which the launcher passes on (any other failure: 1).
CONFIG_ERROR_EXIT = 2
DIVERGED_EXIT = 3
DEFAULT_MASTER_PORT = 29500
DEFAULT_JOIN_TIMEOUT_S = 600  # torchrun's own default
# What a launcher tells its workers: its id, which names the job (Note [restarts across
# nodes]), and its launch flags, which every node must agree on (agreement.py).
JOB_VARIABLE = "FULLSHARD_JOB"
LAUNCH_VARIABLE = "FULLSHARD_LAUNCH"
# A directory of this node's launcher where each worker that fails writes its exit code:
# when node 0 stops after its own workers failed, another node's launcher can lose the
# rendezvous before it sees its workers' exits, and must still report those.
EXITS_VARIABLE = "FULLSHARD_LAUNCH_EXITS"


def record_worker_exit(code: int) -> None:
    """Called by a worker that fails: leave ``code`` where its launcher looks."""
    directory = os.environ.get(EXITS_VARIABLE)
    if code and directory and os.path.isdir(directory):
        with open(os.path.join(directory, f"rank_{os.environ.get('RANK', '0')}"), "w") as f:
            f.write(str(code))


def _first_worker_exit(directory: str) -> tuple[int, int] | None:
    """(rank, exit code) of the lowest rank of this node that recorded a failure."""
    exits = []
    for name in os.listdir(directory):
        try:
            with open(os.path.join(directory, name)) as f:
                exits.append((int(name.removeprefix("rank_")), int(f.read())))
        except (OSError, ValueError):
            continue  # written as the worker died: not a complete record
    return min(exits, default=None)


@dataclass(frozen=True)
class LaunchOptions:
    """Where and how many workers to start (launch flags: not part of a run's config)."""

    nproc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    max_restarts: int = 0
    join_timeout: int = DEFAULT_JOIN_TIMEOUT_S
    rdzv_id: str = "fullshard"
    """The rendezvous' name; under Slurm the job step's, so two jobs never share one."""

    def check(self) -> None:
        """One-line errors naming the flag (ConfigError)."""
        if self.nproc is not None and self.nproc < 1:
            raise ConfigError(f"--nproc: must be >= 1, got {self.nproc}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes: must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank: must be in [0, --nnodes={self.nnodes}), got "
                              f"{self.node_rank}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts: must be >= 0, got {self.max_restarts}")
        if self.nnodes > 1 and not self.master_addr:
            raise ConfigError("--master-addr: needed with --nnodes > 1 (the address of node 0)")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port: must be in [1, 65535], got {self.master_port}")
        if self.join_timeout < 1:
            raise ConfigError(f"--join-timeout: must be >= 1 second, got {self.join_timeout}")
        check_gpus(self.ranks_here(), "--nproc")

    def ranks_here(self) -> int:
        return self.nproc or default_nproc()

    def must_agree(self) -> dict[str, int]:
        """The flags every node must give alike (--nproc may differ: torchrun allows it,
        but the trainer's "one replica per node" does not, so it is compared too)."""
        return {"--nnodes": self.nnodes, "--nproc": self.ranks_here(),
                "--max-restarts": self.max_restarts}


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


@dataclass(frozen=True)
class Attempt:
    """Which job this is and which of its attempts, as every rank agreed."""

    job: str | None
    restart: int


_AGREED: Attempt | None = None  # set once per worker process by agree_on_attempt


def is_worker() -> bool:
    """Whether a launcher (torchrun, ours or someone's, or a scheduler that sets
    torch.distributed's environment) started this process as one rank of a job."""
    return "WORLD_SIZE" in os.environ and ("LOCAL_RANK" in os.environ or "RANK" in os.environ)


def restart_count() -> int:
    """Which attempt of the job this worker is: 0 first (and outside torchrun), then
    1, 2, ... after torchrun restarted the job (see Note [restarts] in checkpoints.py and
    Note [restarts across nodes])."""
    if _AGREED is not None:
        return _AGREED.restart
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def job_id() -> str | None:
    """The job's id, the same on every attempt (Note [restarts across nodes]); None when
    no launcher named it."""
    if _AGREED is not None:
        return _AGREED.job
    return os.environ.get(JOB_VARIABLE) or os.environ.get("TORCHELASTIC_RUN_ID")


def agree_on_attempt() -> Attempt:
    """Collective, right after the process group exists: the largest attempt over ranks
    and rank 0's job id become this worker's (Note [restarts across nodes])."""
    global _AGREED
    mine = (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            os.environ.get(JOB_VARIABLE) or os.environ.get("TORCHELASTIC_RUN_ID"))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    _AGREED = Attempt(job=everyone[0][1], restart=max(count for count, _ in everyone))
    return _AGREED


def default_nproc() -> int:
    """One rank per GPU; on CPU two ranks (sharding needs at least two to mean much)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def rendezvous_flags(options: LaunchOptions) -> list[str]:
    """torchrun's flags for where the nodes meet (one node: a free local port)."""
    if options.nnodes == 1 and options.master_addr is None:
        return ["--standalone"]
    # Node 0 hosts the rendezvous' store; no other guesses from its address (a name that
    # is not this machine's, or 127.0.0.1 for nodes simulated on one machine).
    host = "true" if options.node_rank == 0 else "false"
    # read_timeout bounds the wait for node 0's store to exist, as join_timeout bounds
    # the wait for the other nodes.
    conf = f"join_timeout={options.join_timeout},read_timeout={options.join_timeout}," \
           f"is_host={host}"
    return ["--nnodes", str(options.nnodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{options.master_addr}:{options.master_port}",
            "--rdzv-id", options.rdzv_id, "--rdzv-conf", conf]


def launch(options: LaunchOptions, worker_argv: list[str]) -> int:
    """Run ``python -m fullshard.cli train WORKER_ARGV`` on ``options.nproc`` local ranks
    (joining ``options.nnodes`` nodes) and wait for them; returns an exit code, or raises
    ConfigError when the nodes do not meet.
    ``worker_argv`` holds no launch flag: workers never see them, nor does torchrun's
    parser (which would take ``--nproc`` for an abbreviation of its own flags)."""
    from torch.distributed.run import parse_args, run

    nproc = options.ranks_here()
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
    os.environ[JOB_VARIABLE] = uuid.uuid4().hex
    os.environ[LAUNCH_VARIABLE] = " ".join(f"{k}={v}" for k, v in options.must_agree().items())
    args = parse_args(["--nproc-per-node", str(nproc), "--max-restarts",
                       str(options.max_restarts), *rendezvous_flags(options),
                       "-m", "fullshard.cli"])
    args.training_script_args = ["train", *worker_argv]
    where = f"{options.master_addr}:{options.master_port}"
    exits = tempfile.mkdtemp(prefix="fullshard-exits-")
    os.environ[EXITS_VARIABLE] = exits
    try:
        return _run_agent(run, args, options, where, exits)
    finally:
        shutil.rmtree(exits, ignore_errors=True)


def _worker_failed(rank: int, code: int) -> int:
    print(f"fullshard train: rank {rank} failed with exit code {code} (the error is printed "
          "above)", file=sys.stderr)
    return code if code in (CONFIG_ERROR_EXIT, DIVERGED_EXIT) else 1


def _run_agent(run, args, options: LaunchOptions, where: str, exits: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError,
                                                          RendezvousConnectionError,
                                                          RendezvousTimeoutError)
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        return _worker_failed(rank, failure.exitcode)
    except SignalException as err:
        print(f"fullshard train: stopped by {signal.Signals(err.sigval).name}", file=sys.stderr)
        return 130
    except (RendezvousTimeoutError, RendezvousClosedError, RendezvousConnectionError) as err:
        failed = _first_worker_exit(exits)
        if failed is not None:  # the workers met, and failed: the rendezvous went after
            return _worker_failed(*failed)
        raise _nodes_not_met(err, options, where) from None
    return 0


def _nodes_not_met(err: Exception, options: LaunchOptions, where: str) -> ConfigError:
    """What a rendezvous error before the workers met says about the launch flags."""
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError,
                                                          RendezvousTimeoutError)
    if isinstance(err, RendezvousTimeoutError):
        return ConfigError(
            f"--nnodes {options.nnodes}: fewer nodes than that joined the rendezvous at "
            f"{where} within --join-timeout {options.join_timeout} s; start fullshard train "
            "on every node, with the same --nnodes, --master-addr and --master-port")
    if isinstance(err, RendezvousClosedError):
        return ConfigError(
            f"--nnodes {options.nnodes}: the rendezvous at {where} was closed by another "
            "node (it gave up waiting, or was started with another --nnodes); start "
            "fullshard train on every node with the same --nnodes")
    if options.node_rank == 0:  # a RendezvousConnectionError
        return ConfigError(
            f"--master-port {options.master_port}: node 0 could not host the rendezvous "
            f"at {where} (the port is taken, or --master-addr is not this machine); "
            "choose a free --master-port, the same on every node")
    return ConfigError(
        f"--master-addr {options.master_addr}: no rendezvous at {where} within "
        f"--join-timeout {options.join_timeout} s (node 0 not started, or it gave up "
        "waiting); start node 0 (--node-rank 0) there with the same --nnodes, or "
        "correct --master-addr/--master-port")


def process_group_backend(device_type: str, offload: bool) -> str:
    """The default group's backend: gloo on CPU; NCCL on CUDA, with gloo beside it for
    CPU tensors when the run offloads. Offloaded gradients are DTensors whose local
    tensors live on the host, on the CUDA mesh: anything that reduces them over the mesh
    (torch's ``clip_grad_norm_``, a DTensor ``full_tensor()``) sends a CPU tensor through
    the mesh's group, which NCCL alone refuses ("No backend type associated with device
    type cpu"). torchtitan initializes "cpu:gloo,cuda:nccl" for the same reason."""
    if device_type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if offload else "nccl"


def start_worker(offload: bool = False) -> Worker:
    """Join the process group: NCCL and one GPU per local rank on CUDA (and gloo for host
    tensors with ``offload``: ``process_group_backend``), gloo on CPU."""
    global _JOINED
    _JOINED = True
    local_rank, local_world = local_place(os.environ)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend("cuda", offload), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(process_group_backend("cpu", offload))
    return Worker(dist.get_rank(), dist.get_world_size(), local_rank, local_world, device)


def stop_worker() -> None:
    # Drop everything that still references the process group first: gloo can abort at
    # interpreter exit if a live object holds it (see examples/quickstart.py).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# Note [a worker's process ends without the interpreter's finalization]
# A worker's process groups outlive destroy_process_group(): torch's device meshes keep the
# default group alive (runs of torch's own fully_shard too), so gloo's worker threads are
# still there when the interpreter finalizes. A thread that then lets go of the last
# reference to a Python tensor must take the GIL, is ended on the spot inside a C++
# destructor, and the process aborts ("terminate called without an active exception",
# SIGABRT) after a run that finished: its launcher reports the rank as failed, and the
# other nodes wait in torch elastic's exit barrier for a node that is gone. Note
# [collectives settle before exit] (core/comm.py) makes that rare for any program; it
# still happened at the end of a 2 x 2 run on a loaded machine. A process that joined as a
# worker of ``fullshard train`` makes it impossible: once its command returns, it does
# what Python's own exit does while the interpreter is whole (waits for its other
# non-daemon threads and executors, runs the atexit handlers, flushes its streams) and
# then ends with os._exit, which finalizes nothing. Its files were closed by the code
# that wrote them; the operating system closes its sockets. Only the program's entry
# (``fullshard.cli.entry``) ends this way: ``main()`` called in a process that goes on
# returns as before.
_JOINED = False  # whether this process joined a job's process group (start_worker)


def joined_as_worker() -> bool:
    """Whether this process joined a job's process group through ``start_worker``."""
    return _JOINED


def end_worker_process(code: int) -> NoReturn:
    """Note [a worker's process ends without the interpreter's finalization]."""
    # What the interpreter itself calls first at exit: it tells idle executors' threads to
    # end (a ThreadPoolExecutor never shut down, as the background checkpoint writer's),
    # then joins every non-daemon thread. Joining them alone would wait forever on those.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to say on it
            pass
    os._exit(code)


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
