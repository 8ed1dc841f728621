"""OverlappedStep(delayed=True): ZeRO-Offload's one-step delayed update (Note [the delayed
update]). The run equals, bit for bit, the same sharded model stepped by the optimizer's own
step with the delay written out: the offloaded units' forward and backward of step t+1 run
on their parameters before step t's update, the updates applied in order; what reads the
parameters sees the updated ones; a resume restores the copies and trains on exactly."""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from fullshard import CPUOffloadPolicy, OverlappedStep, fully_shard
from fullshard import checkpoint as ckpt
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.policies import DiskOffloadPolicy
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch

CFG = GPTConfig(vocab_size=40, seq_len=10, d_model=16, n_layers=4, n_heads=2)


def _model(offloaded, disk=None):
    torch.manual_seed(0)
    model = GPT(CFG)
    policy = DiskOffloadPolicy(path=disk) if disk else CPUOffloadPolicy(pin_memory=False)
    for i, layer in enumerate(model.layers):
        fully_shard(layer, offload_policy=policy if i in offloaded else None)
    fully_shard(model, offload_policy=policy if "root" in offloaded else None)
    if "batched" not in offloaded:  # else small blocks gather and reduce as one batch
        model.set_bucket_numel(0)  # a group per block
    return model


def _optimizer(model, kind):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1,
                             fused=kind == "fused", foreach=kind == "foreach")


def _is_offloaded(name, offloaded):
    """Whether parameter ``name`` of the GPT belongs to an offloaded unit."""
    if name.startswith("layers."):
        return int(name.split(".")[1]) in offloaded
    return "root" in offloaded


def _offloaded_locals(model, offloaded):
    """The local shards of the offloaded units' parameters, by name."""
    return {name: p._local_tensor for name, p in model.named_parameters()
            if _is_offloaded(name, offloaded)}


@contextlib.contextmanager
def _computing_with(tensors: dict, values: dict | None):
    """Forward and backward inside see ``values`` in ``tensors`` (when given); the current
    values are back afterwards."""
    current = None
    with torch.no_grad():
        if values is not None:
            current = {k: v.clone() for k, v in tensors.items()}
            for k, v in tensors.items():
                v.copy_(values[k])
    yield
    with torch.no_grad():
        if current is not None:
            for k, v in tensors.items():
                v.copy_(current[k])


def _batch(step):
    return token_batch(10 * step + dist.get_rank(), 6, CFG.vocab_size, CFG.seq_len)


def _set_flags(opt, kind, step):
    if kind == "fused":  # a clip coefficient and a skip flag, known at step()
        opt.grad_scale = torch.tensor(1.5 + step)
        opt.found_inf = torch.tensor(float(step == 3))


def _reference(offloaded, kind, steps, delay_after):
    """The delay written out: before step t+1's forward the offloaded shards are set to
    their values before step t's update, and back to the current ones before the step."""
    model = _model(offloaded)
    opt = _optimizer(model, kind)
    locals_ = _offloaded_locals(model, offloaded)
    before_last = None  # the offloaded shards before the last update, if it is delayed
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        with _computing_with(locals_, before_last):
            loss = lm_loss(model(x), y)
            loss.backward()
        losses.append(loss.detach())
        before = {k: v.detach().clone() for k, v in locals_.items()}
        _set_flags(opt, kind, step)
        opt.step()
        opt.grad_scale = opt.found_inf = None
        opt.zero_grad(set_to_none=True)
        before_last = before if step + 1 > delay_after else None
    return model, opt, losses


def _delayed(offloaded, kind, steps, delay_after):
    model = _model(offloaded)
    opt = _optimizer(model, kind)
    stepper = OverlappedStep(opt, delayed=True, delay_after=delay_after)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        _set_flags(opt, kind, step)
        stepper.step()
        opt.grad_scale = opt.found_inf = None
        opt.zero_grad(set_to_none=True)
    return model, opt, losses


def _weights_and_states(model, opt):
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    states = {(k, name): (v.full_tensor() if hasattr(v, "full_tensor") else v)
              for k, p in model.named_parameters() for name, v in opt.state[p].items()}
    return weights, states


def _differ(a: dict, b: dict) -> list:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))]


def _same_bits(offloaded, kind, delay_after, steps=5):
    ref_model, ref_opt, ref_losses = _reference(offloaded, kind, steps, delay_after)
    model, opt, losses = _delayed(offloaded, kind, steps, delay_after)
    exact_model, exact_opt, exact_losses = _reference(offloaded, kind, steps, steps)
    differ = [_differ(a, b) for a, b in zip(_weights_and_states(ref_model, ref_opt),
                                            _weights_and_states(model, opt))]
    loss_differ = [i for i, (a, b) in enumerate(zip(ref_losses, losses)) if not torch.equal(a, b)]
    # the delay is real: the exact run's losses part from the delayed one's after warm-up
    parted = [i for i, (a, b) in enumerate(zip(exact_losses, losses)) if not torch.equal(a, b)]
    return differ, loss_differ, parted


@pytest.mark.slow  # make test runs it; make test-fast has no time left
@pytest.mark.parametrize("world,offloaded,kind,delay_after", [
    (2, {1, 3}, "foreach", 0),
    (3, {0, 1, 2, 3, "root"}, "sgd", 0),
    (2, {0, 2, "root"}, "fused", 0),   # a clip coefficient and a skipped step
    (2, {0, 1, 2, 3}, "foreach", 2),  # two exact warm-up steps
    (2, {0, 1, 2, 3, "batched"}, "foreach", 0),  # the four blocks one batch
])
def test_the_delayed_run_equals_the_delay_written_out(world, offloaded, kind, delay_after):
    for differ, loss_differ, parted in run_distributed(_same_bits, world, offloaded, kind,
                                                       delay_after):
        assert differ == [[], []] and loss_differ == [], (differ, loss_differ)
        # the first delay_after + 1 losses see the exact run's parameters, later ones not
        assert parted and min(parted) == delay_after + 1, parted


def _reads(batched):
    """What each reader sees between step() and the next forward."""
    offloaded = {0, 1, 2, 3, "root"} | ({"batched"} if batched else set())
    model = _model(offloaded)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    stepper = OverlappedStep(opt, delayed=True)
    for step in range(2):
        x, y = _batch(step)
        lm_loss(model(x), y).backward()
        before = {k: v.full_tensor() for k, v in model.state_dict().items()}
        stepper.step()
        opt.zero_grad()
    saved = {k: v.full_tensor() for k, v in model.state_dict().items()}  # waits: updated
    moved = [k for k in saved if not torch.equal(saved[k], before[k])]
    stepper.wait()
    # an explicit unshard() gathers what the next forward computes with: the copy
    model.layers[0].unshard()
    gathered = model.layers[0].attn.qkv.weight.detach().clone()
    model.layers[0].reshard()
    pending = stepper.delayed_state_dict()["pending"]
    copy_key = next(f"0.{i}" for i, p in enumerate(opt.param_groups[0]["params"])
                    if p is model.layers[0].attn.qkv.weight)
    as_copy = torch.equal(gathered, pending[copy_key].full_tensor())
    as_before = torch.equal(gathered, before["layers.0.attn.qkv.weight"])
    # loading the module's parameters: the next forward computes with them
    model.load_state_dict(model.state_dict())
    model.layers[0].unshard()
    loaded = torch.equal(model.layers[0].attn.qkv.weight.detach(),
                         saved["layers.0.attn.qkv.weight"])
    model.layers[0].reshard()
    return len(moved) == len(saved), as_copy, as_before, loaded, stepper.delayed_state_dict()


@pytest.mark.slow  # make test runs it; make test-fast has no time left
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "in_a_batch"])
def test_readers_see_the_update_and_gathers_the_copy_until_a_load(batched):
    for moved, as_copy, as_before, loaded, after_load in run_distributed(_reads, 2, batched):
        assert moved and as_copy and as_before and loaded
        assert after_load["pending"] == {} and after_load["steps"] == 2


def _train(model, opt, stepper, steps):
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        stepper.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _uninterrupted(offloaded, total):
    model = _model(offloaded)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, foreach=True)
    stepper = OverlappedStep(opt, delayed=True, delay_after=1)
    losses = _train(model, opt, stepper, range(total))
    return losses, _weights_and_states(model, opt)


def _save_at(offloaded, k, path):
    model = _model(offloaded)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, foreach=True)
    stepper = OverlappedStep(opt, delayed=True, delay_after=1)
    _train(model, opt, stepper, range(k))
    ckpt.save(os.path.join(path, "ckpt"), model, opt)
    state = stepper.delayed_state_dict()
    torch.save({"steps": state["steps"],
                "pending": {key: v.to_local() for key, v in state["pending"].items()}},
               os.path.join(path, f"delayed-{dist.get_rank()}.pt"))
    return len(state["pending"])


def _resume_from(offloaded, k, total, path):
    model = _model(offloaded)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, foreach=True)
    stepper = OverlappedStep(opt, delayed=True, delay_after=1)
    ckpt.load(os.path.join(path, "ckpt"), model, opt)
    stepper.load_delayed_state_dict(
        torch.load(os.path.join(path, f"delayed-{dist.get_rank()}.pt")), model)
    losses = _train(model, opt, stepper, range(k, total))
    return losses, _weights_and_states(model, opt)


@pytest.mark.slow  # make test runs it; make test-fast has no time left
def test_a_resume_in_fresh_processes_trains_on_as_the_uninterrupted_run(tmp_path):
    offloaded, k, total = {0, 2, 3, "root"}, 3, 6
    whole = run_distributed(_uninterrupted, 2, offloaded, total)
    saved = run_distributed(_save_at, 2, offloaded, k, str(tmp_path))
    assert all(n > 0 for n in saved)  # copies were pending at the save
    resumed = run_distributed(_resume_from, 2, offloaded, k, total, str(tmp_path))
    for (losses, (weights, states)), (rlosses, (rweights, rstates)) in zip(whole, resumed):
        assert all(torch.equal(a, b) for a, b in zip(losses[k:], rlosses)), (losses, rlosses)
        assert _differ(weights, rweights) == [] and _differ(states, rstates) == []


# -- what is refused (docs/errors.md E345-E349) -------------------------------------------
def _refusals(disk):
    from fullshard.optim import set_local_step

    def message_of(fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - the message is what is compared
            return f"{type(err).__name__}: {err}"
        return "NO ERROR RAISED"

    out = {}
    os.makedirs(os.path.join(disk, str(dist.get_rank())), exist_ok=True)
    on_disk = _model({1}, disk=os.path.join(disk, str(dist.get_rank())))
    out["E345"] = message_of(lambda: OverlappedStep(
        torch.optim.AdamW(on_disk.parameters()), delayed=True))
    model = _model({0, 1})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stepper = OverlappedStep(opt, delayed=True)
    x, y = _batch(0)
    lm_loss(model(x), y).backward()
    set_local_step(False)
    try:
        out["E348"] = message_of(stepper.step)
    finally:
        set_local_step(True)
    stepper.step()
    state = stepper.delayed_state_dict()
    wrong = {"steps": 1, "pending": {"0.999": next(iter(state["pending"].values()))}}
    out["E349"] = message_of(lambda: stepper.load_delayed_state_dict(wrong, model))
    key, value = next(iter(state["pending"].items()))
    shaped = {"steps": 1, "pending": {key: torch.zeros(value.to_local().numel() + 1)}}
    out["E349 shape"] = message_of(lambda: stepper.load_delayed_state_dict(shaped, model))
    return out


def test_disk_offload_local_step_off_and_a_foreign_state_are_refused_in_one_line(tmp_path):
    from support.catalogue import matches_documented
    for out in run_distributed(_refusals, 2, str(tmp_path)):
        for code, message in out.items():
            assert matches_documented(code.split()[0], message), (code, message)


def _one_rank_parameters_are_not_the_shard():
    """At one rank the parameters are views of the shard (Note [shard groups of one
    rank]); a delayed unit gathers a copy instead, so the host thread writes no tensor the
    forward reads."""
    differ, loss_differ, parted = _same_bits({0, 1, 2, 3, "root"}, "foreach", 0)
    return differ, loss_differ, parted


def test_at_one_rank_the_delayed_run_equals_the_delay_written_out():
    (differ, loss_differ, parted), = run_distributed(_one_rank_parameters_are_not_the_shard, 1)
    assert differ == [[], []] and loss_differ == [] and min(parted) == 1


def _forward_does_not_wait():
    """The host step of every unit is slow: the next forward and backward end before it,
    and the values are still those of the delay written out (the backward wrote its
    gradients beside the ones the slow step was reading)."""
    import time

    import fullshard.overlapped_step as overlapped_step
    real = overlapped_step._step_unit
    ended, done = [], []

    def slow(*args):
        time.sleep(0.5)
        real(*args)
        ended.append(time.monotonic())

    offloaded = {0, 1, 2, 3, "root"}
    overlapped_step._step_unit = slow
    try:
        model = _model(offloaded)
        opt = _optimizer(model, "foreach")
        stepper = OverlappedStep(opt, delayed=True)
        for step in range(3):
            x, y = _batch(step)
            lm_loss(model(x), y).backward()
            done.append(time.monotonic())
            stepper.step()
            opt.zero_grad(set_to_none=True)
        stepper.wait()
    finally:
        overlapped_step._step_unit = real
    ref_model, ref_opt, _losses = _reference(offloaded, "foreach", 3, 0)
    differ = [_differ(a, b) for a, b in zip(_weights_and_states(ref_model, ref_opt),
                                            _weights_and_states(model, opt))]
    return done[1] < ended[0], differ


@pytest.mark.slow  # make test runs it; make test-fast has no time left
def test_the_next_forward_and_backward_wait_for_no_host_step():
    for overlapped, differ in run_distributed(_forward_does_not_wait, 2):
        assert overlapped and differ == [[], []], differ


def _single_process(offloaded, steps, world):
    """One process, no sharding, the global batch: the offloaded blocks' forward of step
    t+1 runs on their parameters before step t's update (SGD with momentum)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    delayed = {n: p for n, p in model.named_parameters() if _is_offloaded(n, offloaded)}
    before_last, losses = None, []
    for step in range(steps):
        batches = [token_batch(10 * step + r, 6, CFG.vocab_size, CFG.seq_len)
                   for r in range(world)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        with _computing_with(delayed, before_last):
            loss = lm_loss(model(x), y)
            loss.backward()
        losses.append(loss.detach())
        before_last = {n: p.detach().clone() for n, p in delayed.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


def _sharded_weights(offloaded, steps):
    model, _opt, losses = _delayed(offloaded, "sgd", steps, 0)
    for loss in losses:
        dist.all_reduce(loss)
    world = dist.get_world_size()
    return ({k: v.full_tensor() for k, v in model.state_dict().items()},
            [loss / world for loss in losses])


@pytest.mark.slow  # make test runs it; make test-fast has no time left
@pytest.mark.parametrize("world", [2, 3])
def test_the_delayed_run_trains_as_a_single_process_with_the_delay(world):
    offloaded, steps = {0, 2, 3, "root"}, 5
    weights, losses = _single_process(offloaded, steps, world)
    sharded, sharded_losses = run_distributed(_sharded_weights, world, offloaded, steps)[0]
    torch.testing.assert_close(torch.stack(sharded_losses), torch.stack(losses),
                               rtol=1e-5, atol=1e-6)
    for key in weights:
        torch.testing.assert_close(sharded[key], weights[key], rtol=1e-5, atol=1e-6)
