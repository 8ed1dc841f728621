"""``fullshard train``'s launch flags and the environments that replace them (Slurm, a
launcher that sets torch.distributed's variables, CUDA's GPU count), in-process: what
reaches torchrun and the workers, and the one-line errors. The runs themselves:
tests/train/test_launch_multinode.py."""

import argparse
import os
import re
import shlex

import pytest
import torch
import torch.distributed.run
import yaml
from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError,
                                                      RendezvousConnectionError,
                                                      RendezvousTimeoutError)

from fullshard.cli import launch_flags
from fullshard.cli import train as train_cli
from fullshard.train.launch.cluster import slurm_launch_settings
from fullshard.train.config.schema import ConfigError
from support.catalogue import matches_documented

# A negative value too: it must stay with its flag.
RUN_FLAGS = ["--preset", "debug", "--steps", "5", "--out", "runs/x", "--seed", "-3"]
EVERY_LAUNCH_FLAG = ["--nproc", "3", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                     "10.0.0.1", "--master-port", "1234", "--max-restarts", "4",
                     "--join-timeout", "9"]


@pytest.fixture
def torchrun_calls(monkeypatch) -> list:
    """torchrun's parsed arguments for each launch, instead of launching; the launcher's
    environment changes stay in a copy."""
    calls = []
    monkeypatch.setattr(torch.distributed.run, "run", calls.append)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if not k.startswith(("SLURM_", "PET_"))})
    return calls


def test_launch_flags_reach_torchrun_and_never_the_workers(torchrun_calls):
    # Launch flags anywhere on the line, in both spellings (`--flag value`, `--flag=value`).
    argv = ["--nproc=3", *RUN_FLAGS[:4], *EVERY_LAUNCH_FLAG[2:], *RUN_FLAGS[4:]]
    assert train_cli.main(argv) == 0
    (args,) = torchrun_calls
    assert args.training_script_args == ["train", *RUN_FLAGS]  # in order, nothing else
    assert args.module and args.training_script == "fullshard.cli"
    assert (args.nproc_per_node, args.nnodes, args.max_restarts) == ("3", "2", 4)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "10.0.0.1:1234")
    conf = dict(item.split("=") for item in args.rdzv_conf.split(","))
    assert conf == {"join_timeout": "9", "read_timeout": "9", "is_host": "false"}
    assert os.environ["FULLSHARD_LAUNCH"] == "--nnodes=2 --nproc=3 --max-restarts=4"
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # restarts need it


def test_one_node_uses_a_free_local_port_and_node_0_hosts_the_rendezvous(torchrun_calls):
    assert train_cli.main(["--nproc", "1", *RUN_FLAGS]) == 0
    assert train_cli.main(["--nnodes", "2", "--master-addr", "n0", *RUN_FLAGS]) == 0
    alone, node0 = torchrun_calls
    assert alone.standalone and alone.nproc_per_node == "1" and alone.max_restarts == 0
    assert node0.rdzv_endpoint == "n0:29500" and "is_host=true" in node0.rdzv_conf
    assert node0.nproc_per_node == "2"  # the CPU default
    # Each launch is a job of its own: the id its workers record in checkpoints.
    assert len(os.environ["FULLSHARD_JOB"]) == 32


def test_launch_flags_are_split_off_before_the_run_flags():
    given, rest = launch_flags.split([*RUN_FLAGS, *EVERY_LAUNCH_FLAG])
    assert rest == RUN_FLAGS
    assert vars(given) == {"nproc": 3, "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1",
                           "master_port": 1234, "max_restarts": 4, "join_timeout": 9}
    given, rest = launch_flags.split(RUN_FLAGS)
    assert rest == RUN_FLAGS and set(vars(given).values()) == {None}


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "n0"],
     "--node-rank: must be in [0, --nnodes=2), got 2"),
    (["--nnodes", "2"], "--master-addr: needed with --nnodes > 1 (the address of node 0)"),
])
def test_bad_launch_flags_are_one_line_errors_naming_the_flag(flags, message, capsys,
                                                              torchrun_calls):
    assert train_cli.main([*flags, *RUN_FLAGS]) == 2
    err = capsys.readouterr().err
    assert err == f"fullshard train: {message}\n"
    assert not torchrun_calls


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "0"], "--nproc: must be in [1, 4096], got 0"),
    (["--nnodes", "0"], "--nnodes: must be in [1, 65536], got 0"),
    (["--node-rank", "-1"], "--node-rank: must be in [0, 65535], got -1"),
    (["--master-port", "70000"], "--master-port: must be in [1, 65535], got 70000"),
    (["--max-restarts", "-1"], "--max-restarts: must be in [0, 1000000], got -1"),
    (["--join-timeout", "0"], "--join-timeout: must be in [1, 604800], got 0"),
    (["--nproc", "two"], "--nproc: expected an int in [1, 4096], got 'two'"),
])
def test_launch_numbers_out_of_bounds_are_refused_before_anything_starts(flags, message,
                                                                         capsys, torchrun_calls):
    with pytest.raises(SystemExit) as exit_:
        train_cli.main([*flags, *RUN_FLAGS])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"fullshard train: {message} (see --help)\n"
    assert not torchrun_calls


def test_an_abbreviated_launch_flag_is_refused(capsys, torchrun_calls):
    assert train_cli.main(["--nnode", "2", *RUN_FLAGS]) == 2
    err = capsys.readouterr().err
    assert err == "fullshard train: command line: unknown flag --nnode (see --help)\n"
    assert err.count("\n") == 1 and not torchrun_calls


NODE = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "1234",
        "--join-timeout", "60"]


@pytest.mark.parametrize("failure, node_rank, code, message", [
    (RendezvousTimeoutError, 0, "E62",
     "--nnodes 2: fewer nodes than that joined the rendezvous at 10.0.0.1:1234 within "
     "--join-timeout 60 s; start fullshard train on every node, with the same --nnodes, "
     "--master-addr and --master-port"),
    (RendezvousConnectionError, 1, "E63",
     "--master-addr 10.0.0.1: no rendezvous at 10.0.0.1:1234 within --join-timeout 60 s "
     "(node 0 not started, or it gave up waiting); start node 0 (--node-rank 0) there with "
     "the same --nnodes, or correct --master-addr/--master-port"),
    (RendezvousConnectionError, 0, "E65",
     "--master-port 1234: node 0 could not host the rendezvous at 10.0.0.1:1234 (the port is "
     "taken, or --master-addr is not this machine); choose a free --master-port, the same on "
     "every node"),
    (RendezvousClosedError, 1, "E66",
     "--nnodes 2: the rendezvous at 10.0.0.1:1234 was closed by another node (it gave up "
     "waiting, or was started with another --nnodes); start fullshard train on every node "
     "with the same --nnodes"),
])
def test_nodes_that_do_not_meet_are_one_line_naming_the_flag(failure, node_rank, code, message,
                                                             capsys, monkeypatch, torchrun_calls):
    """torchrun's rendezvous errors (real ones: tests/train/test_launch_multinode.py), as the user sees
    them: one line, no traceback."""
    def fail(args):
        raise failure()
    monkeypatch.setattr(torch.distributed.run, "run", fail)
    assert train_cli.main([*NODE, "--node-rank", str(node_rank), *RUN_FLAGS]) == 2
    err = capsys.readouterr().err
    assert err == f"fullshard train: {message}\n"
    assert matches_documented(code, f"ConfigError: {message}")


# -- GPUs ------------------------------------------------------------------------------

@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_more_ranks_than_gpus_is_refused_before_nccl_sees_them(one_gpu, capsys,
                                                                torchrun_calls):
    assert train_cli.main(["--nproc", "2", *RUN_FLAGS]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--nproc: 2 ranks on this node, but it has 1 visible " \
                                    "GPU and NCCL needs one per rank" in err
    assert matches_documented("E60", "ConfigError: " + err.removeprefix("fullshard train: ")
                              .strip())
    assert not torchrun_calls
    assert train_cli.main(RUN_FLAGS) == 0  # the default: one rank per GPU
    assert torchrun_calls[0].nproc_per_node == "1"


def test_a_worker_started_with_more_ranks_than_gpus_says_so(one_gpu, capsys, monkeypatch):
    # `torchrun --nproc-per-node 2` on a one-GPU machine: refused before joining.
    monkeypatch.setattr(os, "environ", {**os.environ, "LOCAL_RANK": "0", "RANK": "0",
                                        "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"})
    monkeypatch.setattr(train_cli, "start_worker", pytest.fail)  # never reached
    assert train_cli.main(RUN_FLAGS) == 2
    err = capsys.readouterr().err
    assert err == ("fullshard train: LOCAL_WORLD_SIZE (torchrun --nproc-per-node): 2 ranks "
                   "on this node, but it has 1 visible GPU and NCCL needs one per rank; ask "
                   "for 1 or fewer (or make more GPUs visible: CUDA_VISIBLE_DEVICES)\n")
    assert matches_documented("E60", "ConfigError: " + err.removeprefix("fullshard train: ")
                              .strip())


# -- Slurm -----------------------------------------------------------------------------

SRUN = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_NODES": "4",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "2", "SLURM_STEP_NODELIST": "gpu[07-10]"}


def test_under_srun_slurm_gives_the_nodes_the_node_rank_and_the_master(torchrun_calls):
    assert slurm_launch_settings({}) == {}
    assert slurm_launch_settings(SRUN) == {"nnodes": 4, "node_rank": 2, "master_addr": "gpu07",
                                           "rdzv_id": "slurm-812.3"}
    os.environ.update(SRUN)
    assert train_cli.main(RUN_FLAGS) == 0
    assert train_cli.main(["--master-port", "4000", "--nproc", "1", *RUN_FLAGS]) == 0
    derived, flagged = torchrun_calls
    assert (derived.nnodes, derived.rdzv_endpoint, derived.rdzv_id) == ("4", "gpu07:29500",
                                                                         "slurm-812.3")
    assert "is_host=false" in derived.rdzv_conf
    assert flagged.rdzv_endpoint == "gpu07:4000" and flagged.nproc_per_node == "1"


def test_srun_with_several_tasks_per_node_is_refused(capsys, torchrun_calls):
    os.environ.update({**SRUN, "SLURM_STEP_NUM_TASKS": "32"})
    assert train_cli.main(RUN_FLAGS) == 2
    err = capsys.readouterr().err
    assert err == ("fullshard train: srun: 32 tasks on 4 nodes; fullshard train starts the "
                   "ranks of its node itself: run one task per node (srun "
                   "--ntasks-per-node=1) and set --nproc to the ranks per node\n")
    assert matches_documented("E67", "ConfigError: " + err.removeprefix("fullshard train: ")
                              .strip())
    assert not torchrun_calls
    with pytest.raises(ConfigError, match="srun: 32 tasks on 4 nodes"):
        slurm_launch_settings(os.environ)


# -- launchers that set torch.distributed's environment (Kubernetes) -------------------

POD = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1"}


@pytest.mark.parametrize("environment, code, message", [
    ({**POD, "MASTER_ADDR": None}, "E68",
     "MASTER_ADDR: RANK and WORLD_SIZE are set, so this process is one rank of a job another "
     "launcher started, but MASTER_ADDR is not; set MASTER_ADDR and MASTER_PORT (where rank 0 "
     "listens), or unset RANK and WORLD_SIZE to let fullshard train launch its ranks"),
    ({**POD, "PET_NPROC_PER_NODE": "8"}, "E69",
     "PET_NPROC_PER_NODE=8: this pod was meant to start 8 ranks (a PyTorchJob's "
     "nprocPerNode), but its WORLD_SIZE and RANK count one process per pod; set "
     "nprocPerNode: \"1\" (one rank per pod), or run `torchrun -m fullshard train` in the "
     "container"),
])
def test_an_incomplete_worker_environment_is_named(environment, code, message, capsys,
                                                   monkeypatch):
    env = {k: v for k, v in {**os.environ, **environment}.items() if v is not None}
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setattr(train_cli, "start_worker", pytest.fail)  # never reached
    assert train_cli.main(RUN_FLAGS) == 2
    assert capsys.readouterr().err == f"fullshard train: {message}\n"
    assert matches_documented(code, f"ConfigError: {message}")


def test_a_pod_with_one_rank_per_pod_is_a_worker(monkeypatch):
    from fullshard.train.launch.cluster import check_worker_environment, local_place
    from fullshard.train.launch.launcher import is_worker

    monkeypatch.setattr(os, "environ", {**POD, "PET_NPROC_PER_NODE": "auto"})
    assert is_worker() and local_place(os.environ) == (0, 1)
    check_worker_environment(os.environ)  # nothing missing


# -- the files docs/multinode.md gives -------------------------------------------------

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "multinode.md")


def _block(language: str) -> str:
    text = open(DOC).read()
    (block,) = re.findall(rf"```{language}\n(.*?)```", text, re.S)
    return block


def _runs_as_documented(command: list[str]) -> argparse.Namespace:
    """``fullshard train ARGS`` parses, resolves, and gives only the launch flags the
    scheduler does not (the nodes, this node's index and node 0's address come from it)."""
    assert command[:2] == ["fullshard", "train"], command
    given, rest = launch_flags.split(command[2:])
    assert given.nnodes is given.node_rank is given.master_addr is None
    train_cli.resolve_config(train_cli.build_parser().parse_args(rest))
    return given


def test_the_documented_sbatch_script_runs_one_launcher_per_node(torchrun_calls):
    script = _block("bash").replace("\\\n", " ")
    directives = dict(line.removeprefix("#SBATCH --").split("=") for line in
                      script.splitlines() if line.startswith("#SBATCH"))
    assert directives["ntasks-per-node"] == "1"
    (srun,) = [shlex.split(line) for line in script.splitlines() if line.startswith("srun ")]
    given = _runs_as_documented(srun[1:])
    assert given.max_restarts == 3
    # What srun sets in the task on node 1 of this script's 2 nodes.
    nodes = directives["nodes"]
    os.environ.update({**SRUN, "SLURM_STEP_NUM_NODES": nodes, "SLURM_STEP_NUM_TASKS": nodes,
                       "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]"})
    assert train_cli.main(srun[3:]) == 0
    (args,) = torchrun_calls
    assert (args.nnodes, args.rdzv_endpoint, args.max_restarts) == ("2", "gpu07:29500", 3)


def test_the_documented_pytorchjob_runs_one_worker_per_pod():
    job = yaml.safe_load(_block("yaml"))
    assert job["kind"] == "PyTorchJob" and job["spec"]["nprocPerNode"] == "1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    for replica in replicas.values():
        assert replica["restartPolicy"] == "Never"  # a restarted pod would start over
        (container,) = replica["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the container the operator configures
        given = _runs_as_documented(container["command"])
        assert set(vars(given).values()) == {None}  # a worker: launch flags mean nothing
