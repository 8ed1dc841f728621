"""OverlappedStep with optimizer states on disk (Note [the disk step on the host thread]):
each disk-offloaded unit is stepped on the host thread, its chunks streamed through the
same files, while the next forward runs; the same bits as ``optimizer.step()``."""

import os

import pytest
import torch
import torch.distributed as dist

from fullshard import CPUOffloadPolicy, DiskOffloadPolicy, OverlappedStep, fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.offload import disk_states_of
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from support.host_steps import (assert_same_bits, forward_against_slow_last_step,
                                host_steps_slowed, record_handed_during_backward,
                                train_and_read)

CFG = GPTConfig(vocab_size=40, seq_len=10, d_model=32, n_layers=4, n_heads=2)
CHUNK = 4096  # small: the units' states span several chunks each


def _model(directory, placed, params_on_disk=False):
    """``placed``: block index (or "root") -> "disk", "cpu" or absent (on the device)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    policies = {"disk": DiskOffloadPolicy(path=directory, chunk_numel=CHUNK,
                                          params=params_on_disk),
                "cpu": CPUOffloadPolicy(pin_memory=False)}
    for i, layer in enumerate(model.layers):
        fully_shard(layer, offload_policy=policies.get(placed.get(i)))
    fully_shard(model, offload_policy=policies.get(placed.get("root")))
    model.set_bucket_numel(0)  # a group per block
    return model


def _optimizer(model, kind):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # two param groups that cut across every unit, as a decay / no-decay split does
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    other = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": other, "weight_decay": 0.0}], lr=3e-3,
                             fused=kind == "fused", foreach=kind == "foreach")


def _train(directory, placed, kind, overlapped, params_on_disk=False):
    model = _model(directory, placed, params_on_disk)
    opt = _optimizer(model, kind)
    stepper = OverlappedStep(opt) if overlapped else opt
    weights, states = train_and_read(model, opt, stepper, kind, CFG.vocab_size, CFG.seq_len)
    return (weights, states), [len(s.chunks) for s in disk_states_of(opt)]


def _same_bits(directory, placed, kind, params_on_disk=False):
    rank = dist.get_rank()
    for sub in (f"plain{rank}", f"ours{rank}"):
        os.makedirs(f"{directory}/{sub}")
    plain, chunks = _train(f"{directory}/plain{rank}", placed, kind, False, params_on_disk)
    ours, _ = _train(f"{directory}/ours{rank}", placed, kind, True, params_on_disk)
    assert_same_bits(plain, ours)
    return chunks


@pytest.mark.parametrize("world,placed,kind", [
    (2, {0: "disk", 1: "disk", 2: "disk", 3: "disk", "root": "disk"}, "fused"),
    pytest.param(3, {0: "disk", 1: "cpu", 3: "disk"}, "foreach", marks=pytest.mark.slow),
    pytest.param(2, {1: "disk", 2: "disk", "root": "cpu"}, "sgd", marks=pytest.mark.slow),
])
def test_the_same_bits_as_the_optimizers_own_step(tmp_path, world, placed, kind):
    units = sum(v == "disk" for v in placed.values())
    for chunks in run_distributed(_same_bits, world, str(tmp_path), placed, kind):
        assert chunks and chunks[0] > units, chunks  # each unit's own, several for a block


def _same_bits_params_on_disk(directory):
    return _same_bits(directory, {0: "disk", 2: "disk", "root": "disk"}, "foreach",
                      params_on_disk=True)


@pytest.mark.slow
def test_parameters_on_disk_too_give_the_same_bits(tmp_path):
    assert all(run_distributed(_same_bits_params_on_disk, 2, str(tmp_path)))


def _forward_waits_per_unit(directory):
    """The last block's disk step is slow: the first block's forward must start before it
    ends (the step runs on the host thread), the last block's forward only after."""
    os.makedirs(f"{directory}/{dist.get_rank()}")
    model = _model(f"{directory}/{dist.get_rank()}", {i: "disk" for i in range(4)})
    stepper = OverlappedStep(_optimizer(model, "foreach"))
    return forward_against_slow_last_step(model, stepper, "_step_on_disk", CFG.vocab_size,
                                          CFG.seq_len)


@pytest.mark.slow
def test_each_forward_waits_for_its_own_units_disk_step_only(tmp_path):
    for waited, stepped in run_distributed(_forward_waits_per_unit, 2, str(tmp_path)):
        assert waited, stepped
        assert stepped == [f"layers.{i}" for i in range(4)], stepped


def _checkpoint_and_resume(directory):
    """State dicts taken right after step() hold the stepped values (disk reads wait for
    the host steps), and so does a state read by name, also while loaded values are on
    their way to the files; a model and optimizer resumed from them train on as the
    uninterrupted pair does, with and without the overlap."""
    rank = dist.get_rank()
    placed = {0: "disk", 1: "disk", 2: "cpu", "root": "disk"}
    results = []
    for overlapped in (False, True):
        with host_steps_slowed("_step_on_disk", 0.2, on=overlapped):
            results.append(_checkpoint_and_resume_once(directory, placed, overlapped))
    (r0, m0, o0, a0), (r1, m1, o1, a1) = results
    return (torch.equal(r0, r1),
            [k for k in m0 if not torch.equal(m0[k], m1[k])],
            [k for k in o0 if not torch.equal(torch.as_tensor(o0[k]), torch.as_tensor(o1[k]))],
            [k for k in a0 if not torch.equal(a0[k], a1[k])])


def _checkpoint_and_resume_once(directory, placed, overlapped):
    rank = dist.get_rank()
    base = f"{directory}/{rank}-{overlapped}"
    os.makedirs(f"{base}/a"), os.makedirs(f"{base}/b")
    model = _model(f"{base}/a", placed)
    opt = _optimizer(model, "foreach")
    stepper = OverlappedStep(opt) if overlapped else opt
    x, y = token_batch(rank, 4, CFG.vocab_size, CFG.seq_len)
    for _ in range(2):
        lm_loss(model(x), y).backward()
        stepper.step()
        opt.zero_grad()
    # a state read by name right after step(): from disk, once the host step is done
    first = next(p for p in model.layers[0].parameters())
    read = opt.state[first]["exp_avg"].full_tensor()
    saved_model = {k: v.full_tensor() for k, v in model.state_dict().items()}
    saved_opt = {(i, k): (v.full_tensor() if hasattr(v, "full_tensor") else v)
                 for i, entry in opt.state_dict()["state"].items() for k, v in entry.items()}
    resumed = _model(f"{base}/b", placed)
    resumed.load_state_dict(model.state_dict())
    ropt = _optimizer(resumed, "foreach")
    ropt.load_state_dict(opt.state_dict())
    rstepper = OverlappedStep(ropt) if overlapped else ropt
    reads = [read]
    for _ in range(2):  # the loaded states go to disk at the first step, then stream
        lm_loss(resumed(x), y).backward()
        rstepper.step()
        ropt.zero_grad()
        # read by name while the loaded values are still on their way to the files
        reads.append(ropt.state[next(resumed.layers[0].parameters())]["exp_avg"].full_tensor())
    if overlapped:
        rstepper.wait()
    after = {k: v.full_tensor() for k, v in resumed.state_dict().items()}
    return torch.stack(reads), saved_model, saved_opt, after


@pytest.mark.slow
def test_state_dicts_wait_and_a_resume_trains_on_exactly(tmp_path):
    for differ in run_distributed(_checkpoint_and_resume, 2, str(tmp_path)):
        assert differ == (True, [], [], []), differ


def _train_in_backward(directory, placed, in_backward, steps=4):
    model = _model(directory, placed)
    opt = _optimizer(model, "foreach")
    stepper = OverlappedStep(opt)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    during = record_handed_during_backward(stepper, model)
    rank = dist.get_rank()
    for step in range(steps):
        x, y = token_batch(10 * step + rank, 6, CFG.vocab_size, CFG.seq_len)
        loss = lm_loss(model(x), y)
        if in_backward:
            with stepper.stepping_in_backward():
                loss.backward()
        else:
            loss.backward()
        stepper.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
    stepper.wait()
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    states = {(i, name): (v.full_tensor() if hasattr(v, "full_tensor") else v)
              for i, entry in opt.state_dict()["state"].items() for name, v in entry.items()}
    return weights, states, during


def _same_bits_in_backward(directory, placed):
    rank = dist.get_rank()
    os.makedirs(f"{directory}/after{rank}"), os.makedirs(f"{directory}/during{rank}")
    *after, _ = _train_in_backward(f"{directory}/after{rank}", placed, False)
    *stepped, during = _train_in_backward(f"{directory}/during{rank}", placed, True)
    assert_same_bits(after, stepped)
    return during


@pytest.mark.parametrize("world,placed", [
    (2, {0: "disk", 1: "disk", 2: "disk", 3: "disk", "root": "disk"}),
    pytest.param(3, {0: "disk", 1: "cpu", 2: "disk", 3: "disk"}, marks=pytest.mark.slow),
])
def test_stepping_in_backward_gives_the_same_bits_and_steps_disk_units_during_it(
        tmp_path, world, placed):
    blocks = len([u for u in placed if u != "root"])
    for during in run_distributed(_same_bits_in_backward, world, str(tmp_path), placed):
        # every offloaded block of every step handed over while backward still ran
        assert sum(during) >= 4 * blocks, during


def _other_roots_leave_the_files(directory):
    """A second sharded model made and dropped between steps (an evaluation copy) changes
    no unit's place among the optimizer's: its states stay in the files, never read back
    into memory to be laid out again."""
    import gc

    os.makedirs(f"{directory}/{dist.get_rank()}")
    x, y = token_batch(dist.get_rank(), 4, CFG.vocab_size, CFG.seq_len)
    older = _model(f"{directory}/{dist.get_rank()}", {})  # a root made before this one
    older(x).sum().backward()
    placed = {0: "disk", 1: "disk", 2: "disk", 3: "disk"}
    model = _model(f"{directory}/{dist.get_rank()}", placed)
    opt = _optimizer(model, "foreach")
    stepper = OverlappedStep(opt)
    stores = []
    for step in range(4):
        if step == 1:
            del older
            gc.collect()
        if step == 2:
            newer = _model(f"{directory}/{dist.get_rank()}", {})
            newer(x).sum().backward()
        lm_loss(model(x), y).backward()
        stepper.step()
        opt.zero_grad()
        stores.extend(disk_states_of(opt))
    stepper.wait()
    del newer
    return all(s is stores[0] for s in stores), len(stores)


@pytest.mark.slow
def test_another_model_made_or_dropped_leaves_the_states_in_their_files(tmp_path):
    for same, n in run_distributed(_other_roots_leave_the_files, 2, str(tmp_path)):
        assert same and n == 4


def _host_step_inside_the_device_step(directory):
    """Each disk unit handed out in backward starts its host step only once the main
    thread is inside the device step of ``OverlappedStep.step()``, where the optimizer's
    ``param_groups`` hold only what stays on the device; the same bits as stepping after
    backward."""
    import threading
    import time

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from fullshard.offload.optimizer_states import DiskStates

    placed = {0: "disk", 2: "disk"}
    rank = dist.get_rank()
    os.makedirs(f"{directory}/after{rank}"), os.makedirs(f"{directory}/during{rank}")
    *after, _ = _train_in_backward(f"{directory}/after{rank}", placed, False, steps=2)
    inside = threading.Event()
    step_chunks = DiskStates.step_chunks

    def late(self, opt, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            inside.wait(timeout=5)
        return step_chunks(self, opt, *args, **kwargs)

    def in_window(opt, args, kwargs):
        if threading.current_thread() is threading.main_thread():
            inside.set()
            time.sleep(0.2)  # the host steps run now, the groups filtered

    DiskStates.step_chunks = late
    handle = register_optimizer_step_pre_hook(in_window)
    try:
        *stepped, _ = _train_in_backward(f"{directory}/during{rank}", placed, True, steps=2)
    finally:
        DiskStates.step_chunks = step_chunks
        handle.remove()
    assert inside.is_set()
    assert_same_bits(after, stepped)


@pytest.mark.slow
def test_a_disk_step_from_backward_does_not_read_the_groups_step_filters(tmp_path):
    run_distributed(_host_step_inside_the_device_step, 2, str(tmp_path))
