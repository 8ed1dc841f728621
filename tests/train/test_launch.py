"""The process group a worker starts: NCCL for the GPUs, with gloo beside it for the
host tensors of an offloading run; what a launcher reports when its workers fail."""

import os

import pytest

from fullshard.train.config.schema import ConfigError
from fullshard.train.launch import launcher
from fullshard.train.launch.launcher import process_group_backend


def test_offloading_runs_add_gloo_beside_nccl_for_host_tensors():
    assert process_group_backend("cuda", offload=True) == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cuda", offload=False) == "nccl"
    assert process_group_backend("cpu", offload=True) == "gloo"


def _launch_losing_the_rendezvous(monkeypatch, worker_exit):
    """A node whose launcher loses node 0's rendezvous, after its workers exited with
    ``worker_exit`` (None: before they met)."""
    import torch.distributed.run
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    def run(args):
        if worker_exit is not None:  # as a worker of this node does, in its own process
            monkeypatch.setenv("RANK", "1")
            launcher.record_worker_exit(worker_exit)
        raise RendezvousConnectionError("the store on node 0 went away")

    for name in (launcher.JOB_VARIABLE, launcher.LAUNCH_VARIABLE, launcher.EXITS_VARIABLE,
                 "OMP_NUM_THREADS", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # launch() sets them for its workers
    monkeypatch.setattr(torch.distributed.run, "run", run)
    options = launcher.LaunchOptions(nproc=2, nnodes=2, node_rank=1, master_addr="127.0.0.1",
                                     master_port=29555)
    return launcher.launch(options, ["--steps", "1"])


def test_a_lost_rendezvous_after_the_workers_failed_reports_their_exit(monkeypatch, capsys):
    """Node 0 stops once its workers fail; another node can lose the rendezvous before it
    sees its own workers' exits: it reports those, never a rendezvous that was not there."""
    assert _launch_losing_the_rendezvous(monkeypatch, launcher.CONFIG_ERROR_EXIT) == 2
    err = capsys.readouterr().err
    assert err == ("fullshard train: rank 1 failed with exit code 2 (the error is printed "
                   "above)\n")
    assert not os.path.exists(os.environ[launcher.EXITS_VARIABLE])  # removed after the run
    with pytest.raises(ConfigError, match=r"--master-addr 127.0.0.1: no rendezvous at "
                                          r"127.0.0.1:29555 within --join-timeout"):
        _launch_losing_the_rendezvous(monkeypatch, None)
