"""DiskOffloadPolicy: CPU offload whose optimizer states live in files, stepped a chunk at
a time (Note [optimizer states on disk]). The chunks here are small (4096 elements) so
every step crosses many chunk boundaries, several inside one parameter."""

import gc
import os
import resource
import signal

import pytest
import torch
import torch.distributed as dist

import fullshard.checkpoint as fcp
from fullshard import CPUOffloadPolicy, DiskOffloadPolicy, fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.offload import disk_states_of
from fullshard.testing import models as m
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from fullshard.testing.parity import check_parity
from support.mappings import mapping_rss

CFG = GPTConfig(vocab_size=64, seq_len=12, d_model=64, n_layers=2, n_heads=2)
CHUNK = 4096


def _batch(step, n=8):
    return token_batch(step, n, CFG.vocab_size, CFG.seq_len)


def _shard(model, policy):
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)


def _optimizer(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "fused_adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _build(policy, kind):
    torch.manual_seed(0)
    model = GPT(CFG)
    _shard(model, policy)
    return model, _optimizer(kind, model.parameters())


def _train(model, opt, steps, first=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 8 // world
    for step in range(first, first + steps):
        x, y = _batch(step)
        lm_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        opt.step()
        opt.zero_grad()


def _max_diff(model_a, model_b):
    return max((a.to_local() - b.to_local()).abs().max().item()
               for a, b in zip(model_a.parameters(), model_b.parameters()))


def _states_diff(opt_a, opt_b):
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    return max((sa[i][k].to_local() - sb[i][k].to_local()).abs().max().item()
               for i in sa for k in sa[i] if k != "step")


def _same_as_cpu_offload(directory, kind):
    cpu = _build(CPUOffloadPolicy(pin_memory=False), kind)
    disk = _build(DiskOffloadPolicy(path=directory, chunk_numel=CHUNK), kind)
    _train(*cpu, 4)
    _train(*disk, 4)
    model, opt = disk
    (states,) = disk_states_of(opt)
    out = {
        "weights": _max_diff(cpu[0], model),
        "states": _states_diff(cpu[1], opt),
        "chunks": len(states.chunks),
        "placeholders": all(v.device.type == "meta" for s in opt.state.values()
                            for k, v in s.items() if k != "step"),
        "steps": {float(s["step"]) for s in opt.state.values() if "step" in s},
        "written": states.files.bytes_written,
        "capacity": states.files.capacity,
        "files": sorted(f"{name}.bin" for name in states.files.dtypes),
        "named": os.listdir(directory),  # the files have no name
        "open": _open_files_under(directory),
    }
    del disk, model, opt, states
    gc.collect()
    out["removed"] = _open_files_under(directory) == 0
    return out


def _open_files_under(directory) -> int:
    """How many of this process's descriptors hold a file under ``directory``."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
        except OSError:
            pass  # the descriptor listdir itself used
    return found


def _parameters_on_disk(directory):
    cpu = _build(CPUOffloadPolicy(pin_memory=False), "adamw")
    disk = _build(DiskOffloadPolicy(path=directory, chunk_numel=CHUNK, params=True), "adamw")
    _train(*cpu, 3)
    _train(*disk, 3)
    shards = [u.group.flat_shard for u in (disk[0].layers[0]._unit, disk[0]._unit)]
    # after a step nothing of any shard is resident: every use gave its pages back
    left_after_step = [mapping_rss(s) for s in shards]
    # resident now? touch every shard, then give the pages back as a gather does. The
    # shards' own mappings are counted, not the process's resident memory, which the
    # heap's comings and goings move by as much as these small shards hold
    def resident() -> int:
        return sum(mapping_rss(s) for s in shards)

    before = resident()
    touched = sum(float(s.sum()) for s in shards)
    during = resident()
    from fullshard.core.features.mapped import page_out
    for s in shards:
        page_out(s)
    after = resident()
    nbytes = sum(s.numel() * s.element_size() for s in shards)
    out = {"weights": _max_diff(cpu[0], disk[0]), "states": _states_diff(cpu[1], disk[1]),
           "paged_in": during - before, "paged_out": during - after, "shard_bytes": nbytes,
           "touched": touched == touched, "files": os.listdir(directory),
           "left_after_step": left_after_step}
    fcp.save(os.path.join(directory, "ckpt", "s3"), *disk)  # state dicts read mapped shards
    resumed = _build(DiskOffloadPolicy(path=directory, chunk_numel=CHUNK, params=True), "adamw")
    fcp.load(os.path.join(directory, "ckpt", "s3"), *resumed)
    _train(*cpu, 2, first=3)
    _train(*resumed, 2, first=3)
    out["resumed"] = _max_diff(cpu[0], resumed[0])
    return out


@pytest.mark.slow
def test_parameters_on_disk_train_exactly_and_give_their_pages_back(tmp_path):
    """DiskOffloadPolicy(params=True): the flat shards are mappings of files without a
    name (as are the states' files: nothing in the folder but the checkpoint), paged out
    after each use; training, checkpointing and resuming are CPU offload's, bit for bit."""
    for out in run_distributed(_parameters_on_disk, 2, str(tmp_path)):
        assert out["weights"] == 0.0 and out["states"] == 0.0 and out["resumed"] == 0.0, out
        assert out["files"] in ([], ["ckpt"]), out["files"]
        assert out["paged_in"] > 0.5 * out["shard_bytes"], out
        assert out["paged_out"] > 0.5 * out["shard_bytes"], out
        assert out["left_after_step"] == [0, 0], out


def _same_as_cpu_offload_each(directory):
    return {kind: _same_as_cpu_offload(directory, kind)
            for kind in ("adamw", "fused_adamw", "sgd")}


@pytest.mark.slow
def test_disk_offload_steps_exactly_as_cpu_offload(tmp_path):
    for per_kind in run_distributed(_same_as_cpu_offload_each, 2, str(tmp_path)):
        for kind, out in per_kind.items():
            _check_same_as_cpu_offload(kind, out)
    assert os.listdir(tmp_path) == []


def _check_same_as_cpu_offload(kind, out):
    assert out["weights"] == 0.0 and out["states"] == 0.0, out
    assert out["chunks"] >= 10, out
    assert out["placeholders"], "per-element states must not stay in host memory"
    names = {"adamw": ["exp_avg.bin", "exp_avg_sq.bin"],
             "fused_adamw": ["exp_avg.bin", "exp_avg_sq.bin"],
             "sgd": ["momentum_buffer.bin"]}[kind]
    assert out["files"] == names and out["named"] == [] and out["open"] >= len(names)
    assert out["written"] >= 4 * out["capacity"] * 4 * len(names)
    assert out["removed"], "the state folder outlived its optimizer"
    if kind != "sgd":
        assert out["steps"] == {4.0}


def _parity_with_one_process(directory, optimizer):
    policy = DiskOffloadPolicy(path=directory, chunk_numel=CHUNK)
    if optimizer == "sgd":  # SGD with momentum: one state, the GPT's many chunks
        check_parity(lambda: GPT(CFG), lambda model: _shard(model, policy), _batch,
                     lambda model, b: lm_loss(model(b[0]), b[1]), steps=4, optimizer="sgd")
        return
    # AdamW amplifies the reduction-order noise of near-zero gradients (rare tokens'
    # embedding rows), so its parity uses a model without them
    def shard(model):
        for block in model.blocks:
            fully_shard(block, offload_policy=policy)
        fully_shard(model, offload_policy=policy)
    check_parity(m.OddMLP, shard, lambda s: m.float_batch(s, 8, 7, 3), m.mse_loss,
                 steps=4, optimizer="adamw", lr=1e-2)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.slow
def test_disk_offload_parity_with_one_process(optimizer, tmp_path):
    run_distributed(_parity_with_one_process, 2, str(tmp_path), optimizer)


def _resume(directory, ckpt, chunk=CHUNK):
    policy = (DiskOffloadPolicy(path=directory, chunk_numel=chunk) if chunk
              else CPUOffloadPolicy(pin_memory=False))
    straight = _build(CPUOffloadPolicy(pin_memory=False), "adamw")
    _train(*straight, 6)
    first = _build(policy, "adamw")
    _train(*first, 3)
    fcp.save(ckpt, *first)
    del first
    gc.collect()
    resumed = _build(policy, "adamw")  # fresh weights and no states until the load
    fcp.load(ckpt, *resumed)
    _train(*resumed, 3, first=3)
    # the same optimizer rewound to an earlier state dict after it has stepped on disk
    rewound = _build(policy, "adamw")
    _train(*rewound, 3)
    model_sd = {k: v.clone() for k, v in rewound[0].state_dict().items()}
    optim_sd = rewound[1].state_dict()
    optim_sd = {"state": {i: {k: v.clone() for k, v in s.items()}
                          for i, s in optim_sd["state"].items()},
                "param_groups": optim_sd["param_groups"]}
    _train(*rewound, 2, first=3)
    rewound[0].load_state_dict(model_sd)
    rewound[1].load_state_dict(optim_sd)
    _train(*rewound, 3, first=3)
    return _max_diff(straight[0], resumed[0]), _max_diff(straight[0], rewound[0])


@pytest.mark.slow
def test_disk_offload_resumes_from_a_checkpoint_and_a_state_dict(tmp_path):
    ckpt = str(tmp_path / "ckpt" / "step3")
    states = tmp_path / "states"
    states.mkdir()
    for resumed, rewound in run_distributed(_resume, 2, str(states), ckpt):
        assert resumed == 0.0 and rewound == 0.0, (resumed, rewound)


def _policy_errors(tmp):
    def shard(policy):
        fully_shard(torch.nn.Linear(4, 4), offload_policy=policy)
    missing = os.path.join(tmp, "nope")
    with pytest.raises(ValueError, match=r"fully_shard\(Linear\): DiskOffloadPolicy\(path='.*nope'\): "
                                         r"no such directory"):
        shard(DiskOffloadPolicy(path=missing))
    with pytest.raises(ValueError, match=r"DiskOffloadPolicy\(path='/sys'\): the directory is "
                                         r"not writable"):
        shard(DiskOffloadPolicy(path="/sys"))  # sysfs refuses new files, even to root
    with pytest.raises(ValueError, match=r"chunk_numel must be a positive int, got 0"):
        shard(DiskOffloadPolicy(path=tmp, chunk_numel=0))
    with pytest.raises(TypeError):
        DiskOffloadPolicy()  # the path is required
    return True


def test_disk_offload_policy_errors(tmp_path):
    assert run_distributed(_policy_errors, 1, str(tmp_path)) == [True]


def _relative_path_then_chdir(tmp):
    # The policy names its directory relative to where fully_shard ran; the program
    # then changes directory before its first step.
    os.makedirs(os.path.join(tmp, "nvme", "states"))
    os.makedirs(os.path.join(tmp, "elsewhere"))
    before = os.getcwd()
    try:
        os.chdir(os.path.join(tmp, "nvme"))
        model, opt = _build(DiskOffloadPolicy(path="states", chunk_numel=CHUNK), "adamw")
        os.chdir(os.path.join(tmp, "elsewhere"))
        _train(model, opt, 2)
        return os.listdir(os.path.join(tmp, "elsewhere")) == []  # nothing strayed there
    finally:
        os.chdir(before)


def test_a_relative_path_is_the_directory_it_named_when_fully_shard_ran(tmp_path):
    assert run_distributed(_relative_path_then_chdir, 1, str(tmp_path)) == [True]


class _NotElementwise(torch.optim.AdamW):
    """A subclass: fullshard cannot know its update is elementwise."""


def _non_elementwise_optimizer(directory):
    model = GPT(CFG)
    _shard(model, DiskOffloadPolicy(path=directory))
    opt = _NotElementwise(model.parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match=r"_NotElementwise steps parameter 'tok_emb.weight', "
                                           r"whose unit keeps optimizer states on disk"):
        _train(model, opt, 1)
    return True


def test_disk_offload_refuses_an_optimizer_it_cannot_step_in_chunks(tmp_path):
    assert run_distributed(_non_elementwise_optimizer, 1, str(tmp_path)) == [True]


def _disk_full(directory):
    model, opt = _build(DiskOffloadPolicy(path=directory, chunk_numel=CHUNK), "adamw")
    # A file-size limit below the states' size: the kernel refuses the reservation as a
    # full disk would (EFBIG instead of ENOSPC), without filling a real disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(RuntimeError, match=r"DiskOffloadPolicy\(path='.*'\): cannot reserve "
                                               r"[0-9.]+ MiB for optimizer state 'exp_avg' in .*"
                                               r"MiB free there\)\. Free space"):
            _train(model, opt, 1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    del model, opt
    gc.collect()
    return os.listdir(directory)


def test_disk_offload_says_when_the_disk_cannot_take_the_states(tmp_path):
    assert run_distributed(_disk_full, 1, str(tmp_path)) == [[]]


def _resume_with_empty_shards(directory):
    """RowVector's (1, 5) scale leaves every rank but the first an empty shard."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def build(policy):
        torch.manual_seed(0)
        model = m.RowVector()
        fully_shard(model, offload_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, opt, steps, first=0):
        for step in range(first, first + steps):
            x, y = m.float_batch(step, 2 * world, 5, 3)
            m.mse_loss(model, (x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])).backward()
            opt.step()
            opt.zero_grad()

    straight = build(CPUOffloadPolicy(pin_memory=False))
    train(*straight, 4)
    out = {}
    for params in (False, True):
        policy = DiskOffloadPolicy(path=directory, params=params)
        ckpt = os.path.join(directory, f"ckpt-{params}")
        first = build(policy)
        train(*first, 2)
        fcp.save(ckpt, *first)
        resumed = build(policy)
        fcp.load(ckpt, *resumed)
        train(*resumed, 2, first=2)
        out[params] = max(float((a.to_local() - b.to_local()).abs().sum())
                          for a, b in zip(straight[0].parameters(), resumed[0].parameters()))
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_disk_offload_resumes_a_model_with_empty_shards(world, tmp_path):
    """A parameter with fewer rows than ranks: its empty shards step in host memory, so
    every rank's optimizer state dict holds it and the checkpoint loads on every rank."""
    for out in run_distributed(_resume_with_empty_shards, world, str(tmp_path)):
        assert out == {False: 0.0, True: 0.0}, out


def _full_states(directory):
    """Every per-element state gathered whole with ``.full_tensor()``, looked up by name."""
    out = {}
    for name, policy in (("cpu", CPUOffloadPolicy(pin_memory=False)),
                         ("disk", DiskOffloadPolicy(path=directory, chunk_numel=CHUNK))):
        model, opt = _build(policy, "adamw")
        _train(model, opt, 1)
        out[name] = [{k: opt.state[p][k].full_tensor() for k in ("exp_avg", "exp_avg_sq")}
                     for p in model.parameters()]
        out[name + " placeholders"] = all(v.device.type == "meta" for s in opt.state.values()
                                          for k, v in s.items() if k != "step")
    return out


def test_disk_offload_states_gather_whole_as_with_cpu_offload(tmp_path):
    for out in run_distributed(_full_states, 2, str(tmp_path)):
        assert out["disk placeholders"], "the lookup must not bring the states back to memory"
        for cpu, disk in zip(out["cpu"], out["disk"], strict=True):
            for k in cpu:
                assert disk[k].device.type == "cpu" and torch.equal(cpu[k], disk[k]), k
