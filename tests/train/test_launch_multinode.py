"""Several nodes, simulated on one machine: each "node" is its own ``fullshard train``
launcher (2 ranks by default), and they meet in torchrun's c10d rendezvous on
127.0.0.1 at a free port, as nodes of a cluster meet at node 0's address.

Runs are compared with one process training the same model on the same batches
(``_reference``): every layout below reads the same 8 sequences a step (4 ranks x 2,
2 x 4, 1 x 8), so losses and weights agree to float rounding."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from fullshard import checkpoint
from fullshard.gpt import lm_loss
from fullshard.testing import free_port
from fullshard.train.config.schema import get_preset
from fullshard.train.config.flags import apply_overrides
from fullshard.train.data import EpochSampler
from fullshard.train.loop import build_optimizers, learning_rate, set_learning_rate
from fullshard.train.model import build_model, build_workload
from faults.sitecustomize import (COUNT_COLLECTIVES, KILL_AT_STEP, KILL_RANK, STACKS_ON_SIGNAL,
                                  environment)
from support.catalogue import matches_documented
from support.train_runs import ENV, TIMEOUT_S

STEPS, EVERY, SEQUENCES = 4, 2, 8  # SEQUENCES: a step's batch over all ranks
RUN = ["--preset", "debug", "--steps", str(STEPS), "--checkpoint.every", str(EVERY),
       "--eval.every", "0", "--eval.sample-tokens", "0"]
TWO_BY_TWO = ["--nproc", "2", "--batch.batch-size", str(SEQUENCES // 4)]


# -- launching nodes -------------------------------------------------------------------

@dataclass
class Node:
    code: int
    stderr: str


def _run_nodes(commands: list[list[str]], envs: list[dict] | None = None,
               cwds: list[str] | None = None, timeout: float = TIMEOUT_S) -> list[Node]:
    """Start ``fullshard train COMMAND`` for each node at once and wait for all of them
    (output to files: nodes that block on a full pipe would stall the others)."""
    envs = envs or [{}] * len(commands)
    cwds = cwds or [None] * len(commands)
    logs, procs = [], []
    for command, env, cwd in zip(commands, envs, cwds):
        log = tempfile.TemporaryFile("w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "fullshard", "train", *command],
                                      env={**ENV, **environment(STACKS_ON_SIGNAL, 1), **env},
                                      cwd=cwd, stdout=subprocess.DEVNULL,
                                      stderr=log))
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        timed_out = None
    except subprocess.TimeoutExpired:
        _print_stacks(procs)
        timed_out = [os.fstat(log.fileno()).st_size for log in logs]  # the stacks end here
    finally:
        for proc in procs:
            if proc.poll() is None:  # torchrun passes SIGTERM on to its workers
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    nodes = []
    for proc, log in zip(procs, logs):
        log.seek(0)
        nodes.append(Node(proc.returncode, log.read()))
        log.close()
    if timed_out is not None:  # where each node stood tells a hang from a slow machine
        pytest.fail(f"the nodes did not finish within {timeout} s:\n" + "\n".join(
            f"node {k}, its stacks when the wait ran out:\n{node.stderr[:end][-10000:]}\n"
            f"node {k} after SIGTERM (exit {node.code}):\n{node.stderr[end:][-1500:]}"
            for k, (node, end) in enumerate(zip(nodes, timed_out))))
    return nodes


def _print_stacks(procs: list[subprocess.Popen]) -> None:
    """Have each running launcher and its workers print their threads' stacks to the
    node's log (faults/sitecustomize.py), before they are stopped."""
    for pid in [p.pid for p in procs if p.poll() is None]:
        for process in [pid, *_descendants(pid)]:
            try:
                os.kill(process, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(3)


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (name) state ppid ...": the name may hold spaces, never ") "
                parents[int(entry)] = int(f.read().rsplit(") ", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _two_nodes(out: str, *flags: str, env: dict | None = None, **options) -> list[Node]:
    """2 nodes x 2 ranks, node k started with ``--node-rank k``."""
    port = free_port()
    where = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return _run_nodes([[*RUN, *TWO_BY_TWO, *where, "--node-rank", str(k), "--out", out,
                        *flags] for k in range(2)], [env or {}] * 2, **options)


def _assert_succeeded(nodes: list[Node]) -> None:
    for k, node in enumerate(nodes):
        assert node.code == 0, f"node {k}:\n{node.stderr[-4000:]}"
        assert "Traceback" not in node.stderr, f"node {k}:\n{node.stderr[-4000:]}"


# -- what a run left -------------------------------------------------------------------

def _losses(out: str) -> dict[int, float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _weights(out: str, step: int) -> dict[str, torch.Tensor]:
    model = build_model(get_preset("debug").gpt)  # a plain module: the full tensors
    checkpoint.load(os.path.join(out, "checkpoints", f"step_{step:06d}"), model)
    return model.state_dict()


def _collectives(folder: str) -> dict[int, dict]:
    """rank -> {"node": its node, "counts": {"NAME RANKS": calls}} (faults/sitecustomize)."""
    found = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            found[int(name.removeprefix("rank").removesuffix(".json"))] = json.load(f)
    return found


# -- the single-process reference ------------------------------------------------------

@pytest.fixture(scope="module")
def reference() -> dict:
    """Step -> loss, and the weights after ``STEPS`` and after ``STEPS + EVERY`` steps,
    of one process training the debug preset on the whole batch: the trainer's initial
    weights, data order, AdamW and schedule, no fullshard."""
    steps = STEPS + EVERY
    cfg = apply_overrides(get_preset("debug"), {"steps": steps}, "test")
    workload = build_workload(cfg, rank=0)
    model = workload.model
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    [optimizer] = build_optimizers(model, cfg.optim)
    sampler = EpochSampler(workload.train_tokens, cfg.batch.seq_len, SEQUENCES, 0, 1, cfg.seed)
    losses, weights = {}, {}
    for step in range(1, steps + 1):
        set_learning_rate(optimizer, learning_rate(step, cfg.optim))
        x, y = sampler.next_batch()
        loss = lm_loss(model(x).float(), y)
        loss.backward()
        clip = cfg.optim.grad_clip
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step] = loss.item()
        if step in (STEPS, steps):
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "initial": initial}


def _assert_matches_reference(out: str, reference: dict, steps: range, last: int) -> None:
    got = _losses(out)
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step] == pytest.approx(reference["losses"][step], rel=1e-5), step
    weights = _weights(out, last)
    assert weights.keys() == reference["weights"][last].keys()
    for name, want in reference["weights"][last].items():
        # atol 1e-5, not 1e-6: the attention's key bias gets a gradient that is zero but
        # for rounding, and AdamW's m / (sqrt(v) + eps) turns rounding into updates whose
        # size depends on the order of the sums (world size, grouping).
        torch.testing.assert_close(weights[name], want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
        assert not torch.equal(want, reference["initial"][name]), name  # it trained


# -- full_shard and hybrid_shard over 2 nodes ------------------------------------------

@pytest.fixture(scope="module")
def full_shard(tmp_path_factory) -> tuple[str, dict]:
    """A 2 x 2 full_shard run started with the launch flags: its --out, its collectives."""
    tmp = tmp_path_factory.mktemp("full_shard")
    out, counted = str(tmp / "run"), tmp / "collectives"
    counted.mkdir()
    nodes = _two_nodes(out, env=environment(COUNT_COLLECTIVES, counted))
    _assert_succeeded(nodes)
    return out, _collectives(str(counted))


@pytest.mark.slow
def test_full_shard_over_two_nodes_matches_one_process(full_shard, reference):
    out, counts = full_shard
    _assert_matches_reference(out, reference, range(1, STEPS + 1), STEPS)
    # Every collective of every rank spans both nodes: the parameters are sharded 4 ways.
    assert [counts[r]["node"] for r in range(4)] == [0, 0, 1, 1]
    for rank in range(4):
        assert {key.split()[1] for key in counts[rank]["counts"]} == {"0,1,2,3"}


def _slurm_step(node: int) -> dict[str, str]:
    """What ``srun --nodes 2 --ntasks-per-node 1`` sets in the task on node ``node``."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": str(node), "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "127.0.0.[1-2]"}


@pytest.mark.slow
def test_hybrid_shard_under_slurm_shards_in_a_node_and_replicates_across(
        tmp_path, full_shard, reference):
    """Launched as an sbatch script's ``srun`` does (no --nnodes, --node-rank or
    --master-addr: Slurm's variables give them): one replica per node."""
    out, counted = str(tmp_path / "run"), tmp_path / "collectives"
    counted.mkdir()
    port = str(free_port())
    probe = environment(COUNT_COLLECTIVES, counted)
    command = [*RUN, "--batch.batch-size", str(SEQUENCES // 4), "--master-port", port,
               "--parallel.strategy", "hybrid_shard", "--out", out]
    nodes = _run_nodes([command, command], [{**probe, **_slurm_step(k)} for k in range(2)])
    _assert_succeeded(nodes)
    _assert_matches_reference(out, reference, range(1, STEPS + 1), STEPS)

    counts = _collectives(str(counted))
    node_of = {rank: counts[rank]["node"] for rank in range(4)}
    assert node_of == {0: 0, 1: 0, 2: 1, 3: 1}

    def calls(rank: int, name: str, group: str) -> int:
        return sum(n for key, n in _training(counts[rank]["counts"]).items()
                   if key.split()[0] == name and _kind(key.split()[1], node_of) == group)

    whole = _collectives_of_full_shard(full_shard[1])
    for rank in range(4):
        gathers = calls(rank, FLAT_GATHER, "in the node")
        # gloo's reduce-scatter is an all_to_all (Note [reduce-scatter on gloo]).
        scatters = calls(rank, "all_to_all_single", "in the node")
        replicas = calls(rank, "all_reduce", "across the nodes")
        assert gathers > 0 and scatters > 0
        # Each reduce-scattered gradient is then all-reduced with the other node's replica.
        assert replicas == scatters
        # The gathers and reduce-scatters of full_shard, moved into the node.
        assert gathers + calls(rank, FLAT_GATHER, "everyone") == whole[rank][FLAT_GATHER]
        assert scatters + calls(rank, "all_to_all_single", "everyone") == \
            whole[rank]["all_to_all_single"]
        # The clip's gradient norm sums the shards of one replica (after the all-reduce
        # the replicas hold the same gradients): its all-reduce moves into the node too.
        assert calls(rank, "all_reduce", "everyone") + calls(rank, "all_reduce", "in the node") \
            == whole[rank]["all_reduce"]
        assert sum(_training(counts[rank]["counts"]).values()) == \
            sum(whole[rank].values()) + replicas  # nothing else changed group
        # The divergence guard checks every rank of the mesh at once (core/guard/divergence.py).
        assert {_kind(key.split()[1], node_of) for key in counts[rank]["counts"]
                if key.endswith(" guard")} <= {"everyone"}


def _kind(ranks: str, node_of: dict[int, int]) -> str:
    members = [int(r) for r in ranks.split(",")]
    if len(members) == len(node_of):
        return "everyone"
    nodes = {node_of[r] for r in members}
    return "in the node" if len(nodes) == 1 else "across the nodes" \
        if len(nodes) == len(members) else "mixed"


def _training(counts: dict[str, int]) -> dict[str, int]:
    """The collectives of training itself: the divergence guard's own exchanges (keys
    ending ' guard') depend on which collectives carry its digest inline, and a hybrid
    mesh's all-reduce across the nodes carries none."""
    return {key: n for key, n in counts.items() if not key.endswith(" guard")}


# The name fullshard's flat all-gather goes by in torch.distributed (core/comm.py):
# all_gather_single where torch has it (2.13, 2.15), all_gather_into_tensor before (2.11).
FLAT_GATHER = ("all_gather_single" if hasattr(dist, "all_gather_single")
               else "all_gather_into_tensor")


def _collectives_of_full_shard(counts: dict[int, dict]) -> dict[int, dict[str, int]]:
    return {rank: {key.split()[0]: n for key, n in _training(c["counts"]).items()}
            for rank, c in counts.items()}


# -- resuming on another number of nodes -----------------------------------------------

@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.slow
def test_resume_on_one_node_continues_a_two_node_run(tmp_path, full_shard, reference, nproc):
    """2 x 2 -> 1 x nproc, the global batch kept (batch size per rank scaled)."""
    out = str(tmp_path / "run")
    shutil.copytree(full_shard[0], out)
    steps = STEPS + EVERY
    (node,) = _run_nodes([[*RUN, "--steps", str(steps), "--nproc", str(nproc),
                           "--batch.batch-size", str(SEQUENCES // nproc), "--out", out,
                           "--resume"]])
    _assert_succeeded([node])
    assert f"resuming at step {STEPS}," in node.stderr and f"over {nproc} cpu ranks" in \
        node.stderr
    _assert_matches_reference(out, reference, range(1, steps + 1), steps)


# -- restarts --------------------------------------------------------------------------

@pytest.mark.slow
def test_a_worker_killed_on_the_second_node_restarts_both_from_the_checkpoint(
        tmp_path, full_shard):
    """Rank 3 (node 1) dies as step 3 starts; both nodes restart from step 2's checkpoint
    and end with the weights of the uninterrupted run, bit for bit."""
    out = str(tmp_path / "run")
    fault = {**environment(KILL_AT_STEP, EVERY + 1), KILL_RANK: "3"}
    nodes = _two_nodes(out, "--max-restarts", "1", env=fault)
    _assert_succeeded(nodes)
    # The rendezvous numbers the nodes, so either launcher may hold ranks 2-3.
    killed = [node for node in nodes if "exitcode: -9) local_rank: 1" in node.stderr]
    assert len(killed) == 1, [node.stderr[-3000:] for node in nodes]
    resumed = [line for node in nodes for line in node.stderr.splitlines()
               if f"resuming at step {EVERY}," in line]
    assert len(resumed) == 1  # rank 0, wherever it is, after the restart
    uninterrupted = full_shard[0]
    assert _losses(out) == _losses(uninterrupted)
    got, want = _weights(out, STEPS), _weights(uninterrupted, STEPS)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


# -- nodes that do not fit -------------------------------------------------------------

def _one_error_line(node: Node) -> str:
    """The error a node printed: its one ``fullshard train:`` line besides the run's
    banner and the launcher's "rank N failed" summary."""
    lines = [line.removeprefix("fullshard train: ") for line in node.stderr.splitlines()
             if line.startswith("fullshard train: ")]
    errors = [line for line in lines if not line.startswith("gpt (")
              and not re.match(r"rank \d+ failed with exit code \d+ \(the error is printed "
                               r"above\)$", line)]
    assert len(errors) == 1 and "Traceback" not in node.stderr, node.stderr[-4000:]
    return errors[0]


@pytest.mark.slow
def test_nodes_that_never_meet_give_up_after_the_join_timeout(tmp_path):
    """Three rendezvous that cannot complete, side by side: node 0 alone; node 1 alone
    (its node 0 never hosts); two nodes started with different --nnodes. Each launcher
    ends with one line after --join-timeout. (Each message, and a port already taken:
    tests/cli/test_launch_flags.py.)"""
    ports = [free_port() for _ in range(3)]
    common = [*RUN, "--join-timeout", "3", "--master-addr", "127.0.0.1", "--nproc", "1"]

    def node(port: int, rank: int, nnodes: int = 2) -> list[str]:
        return [*common, "--master-port", str(port), "--node-rank", str(rank),
                "--nnodes", str(nnodes), "--out", str(tmp_path / f"{port}-{rank}")]

    nodes = _run_nodes([node(ports[0], 0), node(ports[1], 1), node(ports[2], 0),
                        node(ports[2], 1, nnodes=3)], timeout=90)
    assert [n.code for n in nodes] == [2] * 4, [n.stderr[-2000:] for n in nodes]
    alone, no_host, fewer, more = (_one_error_line(n) for n in nodes)
    assert alone == (f"--nnodes 2: fewer nodes than that joined the rendezvous at "
                     f"127.0.0.1:{ports[0]} within --join-timeout 3 s; start fullshard "
                     "train on every node, with the same --nnodes, --master-addr and "
                     "--master-port")
    assert no_host == (f"--master-addr 127.0.0.1: no rendezvous at 127.0.0.1:{ports[1]} "
                       "within --join-timeout 3 s (node 0 not started, or it gave up "
                       "waiting); start node 0 (--node-rank 0) there with the same "
                       "--nnodes, or correct --master-addr/--master-port")
    # The pair with different --nnodes: either the rendezvous never completes (node 0
    # gives up; node 1 sees the rendezvous close or node 0's store go, whichever first),
    # or c10d lets both in under node 0's --nnodes and the workers, comparing launch flags
    # before they build anything, name the difference on both nodes. Which one happens is
    # a race between the two launchers; both end in one line on each node.
    if fewer.startswith("the nodes disagree: "):
        assert fewer == more and "--nnodes: 2 on node 0 (rank 0), 3 on node 1 (rank 1)" \
            in fewer, (fewer, more)
        assert matches_documented("E61", f"ConfigError: {fewer}"), fewer
    else:
        assert fewer.startswith("--nnodes 2: fewer nodes than that joined"), fewer
        assert any(matches_documented(code, f"ConfigError: {more}")
                   for code in ("E62", "E63", "E66")), more
    # no worker ever started where no rendezvous completed
    assert not any(name.startswith((f"{ports[0]}-", f"{ports[1]}-"))
                   for name in os.listdir(tmp_path))


@pytest.mark.slow
def test_a_node_with_another_config_is_named_on_every_node(tmp_path):
    """Node 1 differs in two fields and a launch flag: the workers compare before they
    build anything."""
    port = free_port()
    where = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--out", str(tmp_path / "run")]
    node0 = [*RUN, "--nproc", "1", *where, "--node-rank", "0"]
    node1 = [*RUN, "--nproc", "2", *where, "--node-rank", "1", "--steps", "9",
             "--optim.lr", "0.01"]
    nodes = _run_nodes([node0, node1])
    errors = [_one_error_line(node) for node in nodes]
    assert [node.code for node in nodes] == [2, 2]
    assert errors[0] == errors[1]
    assert errors[0].startswith("the nodes disagree: ")
    for difference in ("--nproc: 1 on node 0 (rank 0), 2 on node 1 (ranks 1-2)",
                       "optim.lr: 0.003 on node 0 (rank 0), 0.01 on node 1 (ranks 1-2)",
                       "steps: 4 on node 0 (rank 0), 9 on node 1 (ranks 1-2)"):
        assert difference in errors[0], errors[0]
    assert matches_documented("E61", f"ConfigError: {errors[0]}")
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.slow
def test_an_out_that_only_its_own_node_sees_stops_at_the_first_save(tmp_path):
    """The same relative --out from two working directories: each node sees only its
    own files, as with a local disk on each machine."""
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    port = str(free_port())
    command = [*RUN, "--nproc", "1", "--checkpoint.every", "1", "--nnodes", "2",
               "--master-addr", "127.0.0.1", "--master-port", port, "--out", "run"]
    nodes = _run_nodes([[*command, "--node-rank", str(k)] for k in range(2)],
                       cwds=[str(tmp_path / f"node{k}") for k in range(2)])
    errors = [_one_error_line(node) for node in nodes]
    assert [node.code for node in nodes] == [2, 2]
    assert errors[0] == errors[1] == (
        "--out run: rank 1 cannot see the files rank 0 writes in run/checkpoints (a "
        "checkpoint would miss their shards); every node must save to one shared directory "
        "(a network filesystem mounted on each): point --out at one")
    assert matches_documented("E64", f"ConfigError: {errors[0]}")
    for k in range(2):  # nothing committed, nothing half-written
        checkpoints = tmp_path / f"node{k}" / "run" / "checkpoints"
        assert not checkpoints.exists() or os.listdir(checkpoints) == []


# -- Kubernetes: a launcher that sets torch.distributed's environment ------------------

@pytest.mark.slow
def test_pods_of_a_pytorchjob_are_workers(tmp_path, reference):
    """What a PyTorchJob with 2 pods (nprocPerNode "1") sets in each pod's container."""
    out, port = str(tmp_path / "run"), str(free_port())
    pods = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
             "RANK": str(r), "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(r),
             "PET_NNODES": "2", "PYTHONUNBUFFERED": "0"} for r in range(2)]
    command = [*RUN, "--batch.batch-size", str(SEQUENCES // 2), "--out", out]
    nodes = _run_nodes([command, command], pods)
    _assert_succeeded(nodes)
    assert "over 2 cpu ranks" in nodes[0].stderr
    _assert_matches_reference(out, reference, range(1, STEPS + 1), STEPS)
