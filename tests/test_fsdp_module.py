"""Collectives per step, prefetch, manual unshard/reshard, optimizer and state-dict ecosystem."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fullshard import FSDPModule, fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_collectives, count_forward_backward
from fullshard.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=3, n_heads=2)


def _sharded_gpt(raf=True, bucket_numel=0, root_raf=None):
    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=raf)
    fully_shard(model, reshard_after_forward=root_raf)
    model.set_bucket_numel(bucket_numel)
    return model


def _batch(seed=0, n=2):
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randint(0, CFG.vocab_size, (n, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def _count_worker(raf, bucket_numel=0, root_raf=None):
    model = _sharded_gpt(raf, bucket_numel, root_raf)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for step in range(3):
        x, y = _batch(step)
        per_step.append(count_forward_backward(lambda: lm_loss(model(x), y)))
        opt.step()
        opt.zero_grad()
    return per_step


@pytest.mark.parametrize("raf", [True, False])
def test_collectives_per_step_one_per_unit(raf):
    units, layers = CFG.n_layers + 1, CFG.n_layers
    steps = run_distributed(_count_worker, 2, raf)[0]
    # first step: no recorded order yet, so forward gathers synchronously
    fwd, bwd = steps[0]
    assert fwd == {"all_gather": units}
    # later steps: the root gathers on demand, every layer is prefetched
    for fwd, bwd in steps[1:]:
        assert fwd == {"all_gather": 1, "all_gather_async": layers}
    for fwd, bwd in steps:
        expected = {"reduce_scatter": units}
        if raf:  # the layers were freed after forward: gathered again, prefetched
            expected["all_gather_async"] = layers
        assert bwd == expected, (raf, bwd)


def test_explicit_reshard_after_forward_on_the_root_is_honoured():
    """torch's semantics: the root keeps its parameters by default (None), but an explicit
    True frees them after forward, so backward gathers the root again."""
    units, layers = CFG.n_layers + 1, CFG.n_layers
    steps = run_distributed(_count_worker, 2, True, 0, True)[0]
    for fwd, bwd in steps[1:]:
        assert fwd == {"all_gather": 1, "all_gather_async": layers}
        assert bwd == {"all_gather": 1, "all_gather_async": layers, "reduce_scatter": units}


@pytest.mark.parametrize("raf", [True, False])
def test_collectives_per_step_with_small_units_merged(raf):
    """The root and the three tiny layers fit one bucket: one gather per forward, none in
    backward (a bucket with the root stays gathered), one reduce for everything."""
    steps = run_distributed(_count_worker, 2, raf, 1 << 20)[0]
    for fwd, bwd in steps:
        assert fwd == {"all_gather": 1}
        assert bwd == {"reduce_scatter": 1}, (raf, bwd)


def _steps_with_counts(model, opt, steps):
    """Train ``steps`` steps; yield the collectives of each step's forward + backward."""
    for step in range(steps):
        x, y = _batch(step)
        with count_collectives() as c:
            lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        yield dict(c)


def _bucket_worker():
    model = _sharded_gpt(raf=True, bucket_numel=_layer_numel() * 3 // 2)
    return list(_steps_with_counts(model, torch.optim.SGD(model.parameters(), lr=0.1), 2))


def _layer_numel():
    return sum(p.numel() for p in GPT(CFG).layers[0].parameters())


def test_buckets_respect_the_size_cap():
    """A cap of 1.5 layers: the small root joins layer 0 ([root, 0] stays gathered from
    forward to backward), layers 1 and 2 stay alone and are gathered again in backward."""
    counts = run_distributed(_bucket_worker, 2)[0]
    assert counts[0] == {"all_gather": 3, "all_gather_async": 2, "reduce_scatter": 3}
    assert counts[1] == {"all_gather": 1, "all_gather_async": 4, "reduce_scatter": 3}


def _manual_worker():
    model = _sharded_gpt()
    handle = model.unshard(async_op=True)
    handle.wait()
    root_params = [model.tok_emb.weight, model.pos_emb.weight, model.ln_f.weight]
    assert all(not isinstance(p, DTensor) for p in root_params)
    assert model.lm_head.weight is model.tok_emb.weight  # the tie holds while unsharded
    model.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    model.layers[0].unshard()
    w = model.layers[0].attn.qkv.weight
    assert not isinstance(w, DTensor) and w.shape == (3 * CFG.d_model, CFG.d_model)
    model.layers[0].reshard()
    # values seen while unsharded equal the gathered DTensor
    gathered = model.layers[0].attn.qkv.weight.full_tensor()
    model.layers[0].unshard()
    torch.testing.assert_close(model.layers[0].attn.qkv.weight.detach(), gathered)
    model.layers[0].reshard()
    return True


def test_manual_unshard_reshard():
    assert run_distributed(_manual_worker, 2) == [True, True]


def _ecosystem_worker():
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model, GPT) and isinstance(model, FSDPModule)
    assert type(model).__name__ == "FSDPGPT"
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),)
    x, y = _batch(0, n=2)
    world = dist.get_world_size()
    gx = torch.cat([_batch_for_rank(r)[0] for r in range(world)])
    gy = torch.cat([_batch_for_rank(r)[1] for r in range(world)])
    lm_loss(model(x), y).backward()
    lm_loss(ref(gx), gy).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.01)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n: f"clipped grad {n}: {m}")
    with count_collectives() as counts:
        sd = model.state_dict()
    assert not counts
    assert sd.keys() == ref.state_dict().keys()
    for k, v in sd.items():
        assert isinstance(v, DTensor) and v.placements == (Shard(0),), k
    return True


def _batch_for_rank(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.slow
def test_clip_grad_norm_and_state_dict(world_size):
    assert all(run_distributed(_ecosystem_worker, world_size))


def _no_grad_worker():
    model = _sharded_gpt(raf=False)
    x, _ = _batch()
    with torch.no_grad():
        model(x)
    # nothing stays gathered after a forward that no backward will follow
    return all(isinstance(p, DTensor) for p in model.parameters())


def test_eval_forward_leaves_everything_sharded():
    assert run_distributed(_no_grad_worker, 2) == [True, True]


def _stale_worker():
    """A forward without backward, then an optimizer step: the next forward must use
    the new weights, not the copy gathered before the step."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    fully_shard(model, reshard_after_forward=False)
    sharded = list(model.parameters())  # what an optimizer holds
    x, y = _batch()
    model(x)  # grad enabled, never backpropagated: the root stays gathered
    with torch.no_grad():
        for p, rp in zip(sharded, ref.parameters()):
            p.add_(1.0)
            rp.add_(1.0)
    torch.testing.assert_close(model(x), ref(x))
    return True


def test_forward_after_update_uses_new_weights():
    assert run_distributed(_stale_worker, 2) == [True, True]


def _abandoned_forward_worker():
    """A forward with grad whose output is dropped, then a normal step: the dropped
    graph's watches stop counting, so each block still reduces at its module boundary
    during backward (one reduction each, none left for the final callback); then two
    forwards and one backward through both: each block reduces once, both calls in."""
    from fullshard.core import hooks
    model = _sharded_gpt(raf=True)
    x, y = _batch()
    model(x)  # dropped at once: its graph is freed
    in_place = []
    real = hooks._post_backward

    def post_backward(root, group):
        in_place.append(root.backward.running and not _in_final_callback[0])
        return real(root, group)

    _in_final_callback = [False]
    real_final = hooks._final_callback

    def final(root):
        _in_final_callback[0] = True
        try:
            return real_final(root)
        finally:
            _in_final_callback[0] = False

    hooks._post_backward, hooks._final_callback = post_backward, final
    try:
        lm_loss(model(x), y).backward()
        first = list(in_place)
        in_place.clear()
        with count_collectives() as counts:
            (lm_loss(model(x), y) + lm_loss(model(_batch(1)[0]), y)).backward()
    finally:
        hooks._post_backward, hooks._final_callback = real, real_final
    return first, in_place, dict(counts)


@pytest.mark.slow
def test_a_dropped_forward_does_not_hold_back_reductions():
    first, two_forwards, counts = run_distributed(_abandoned_forward_worker, 2)[0]
    # the three blocks at their boundary, the root (token ids) in the final callback
    assert first == [True, True, True, False], first
    assert two_forwards == [True, True, True, False], two_forwards
    assert counts["reduce_scatter"] == CFG.n_layers + 1, counts


def _steady_state_worker(bucket_numel):
    model = _sharded_gpt(raf=True, bucket_numel=bucket_numel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    allocations, counts = [], []
    for c in _steps_with_counts(model, opt, 4):
        allocations.append(model._unit.root.pool.allocations)
        counts.append(c)
    return allocations, counts


@pytest.mark.parametrize("bucket_numel", [0, 1 << 20], ids=["per_unit", "merged"])
@pytest.mark.slow
def test_steady_state_allocates_no_communication_buffers(bucket_numel):
    allocations, counts = run_distributed(_steady_state_worker, 2, bucket_numel)[0]
    # the first step fills the pool; the second is the first with a recorded order
    # (prefetch changes which buffers overlap); from then on nothing new is allocated
    assert allocations[1] > 0
    assert allocations[1] == allocations[2] == allocations[3], allocations
    assert counts[2] == counts[3]


class _Decoder(torch.nn.Module):
    """``decode`` reads the parameters directly, not through ``forward``."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)
        self.out = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x)))

    def decode(self, x):
        return torch.tanh(x @ self.proj.weight.t() + self.proj.bias) @ self.out.weight.t()


def _forward_method_worker():
    from fullshard import register_fsdp_forward_method

    torch.manual_seed(0)
    ref = _Decoder()
    model = copy.deepcopy(ref)
    register_fsdp_forward_method(ref, "decode")  # a plain module: no-op
    fully_shard(model)
    with pytest.raises(ValueError, match="_Decoder has no method 'generate'"):
        register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(model, "decode")
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(model.decode(x), ref.decode(x))
    assert all(isinstance(p, DTensor) for p in model.parameters())  # freed afterwards
    model.decode(x).sum().backward()
    ref.decode(x).sum().backward()
    world = dist.get_world_size()
    for p, rp in zip(model.parameters(), ref.parameters()):
        if rp.grad is None:  # out.bias: decode does not use it
            assert p.grad is None
            continue
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, rtol=1e-5, atol=1e-6)
    return world


def test_register_fsdp_forward_method():
    assert run_distributed(_forward_method_worker, 2) == [2, 2]


def _profiled_step_worker():
    from torch.profiler import ProfilerActivity, profile
    model = _sharded_gpt()
    x, y = _batch()
    lm_loss(model(x), y).backward()  # warm-up: record the order, allocate the pool
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lm_loss(model(x), y).backward()
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if n.startswith("fullshard::"))


def test_profiler_trace_names_every_collective_and_copy():
    names = run_distributed(_profiled_step_worker, 2)[0]
    kinds = {n.split()[0] for n in names}
    assert {"fullshard::all_gather", "fullshard::copy_out", "fullshard::reduce_scatter",
            "fullshard::finish_reduce"} <= kinds, names
    assert "fullshard::all_gather layers.0" in names and "fullshard::reduce_scatter layers.2" in names


def test_no_profiler_range_is_opened_when_no_profiler_runs(monkeypatch):
    from fullshard.core import comm
    opened = []
    monkeypatch.setattr(comm, "record_function", lambda name: opened.append(name))
    with comm.traced("all_gather x"):
        pass
    assert opened == []


def _shared_copies_worker():
    from fullshard import share_comm_ctx
    from fullshard.core.state import unit_of
    models = [_sharded_gpt() for _ in range(3)]
    x, _ = _batch()
    models[0](x)  # already a root when the context is shared: it moves
    share_comm_ctx(models[:2])
    for m in models:
        m(x)
    copies = [unit_of(m).root.copies for m in models]
    groups_follow = all(g.copies is copies[0] for g in unit_of(models[0]).root.members)
    return copies[0] is copies[1], copies[0] is copies[2], groups_follow


def test_share_comm_ctx_gives_the_roots_one_set_of_copy_streams():
    shared, with_third, groups_follow = run_distributed(_shared_copies_worker, 1)[0]
    assert shared and groups_follow and not with_third


def _inference_then_train_worker(bucket_numel, raf):
    """The first forward runs under torch.inference_mode (it lazily initialises, merges
    small units and allocates every buffer), then the model trains, with more
    inference-mode forwards between steps: the same outputs and weights as one process."""
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = _sharded_gpt(raf, bucket_numel)  # seeded as the reference: the same weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x_all = torch.randint(0, CFG.vocab_size, (2 * dist.get_world_size(), CFG.seq_len),
                          generator=torch.Generator().manual_seed(5))
    rank = dist.get_rank()
    x = x_all[2 * rank:2 * rank + 2]
    for step in range(3):
        with torch.inference_mode():
            torch.testing.assert_close(model(x), reference(x_all)[2 * rank:2 * rank + 2])
        lm_loss(model(x), torch.roll(x, -1, 1)).backward()
        # the reference sees the global batch; the mean over ranks of per-rank means
        ref_losses = [lm_loss(reference(x_all[2 * r:2 * r + 2]),
                              torch.roll(x_all[2 * r:2 * r + 2], -1, 1))
                      for r in range(dist.get_world_size())]
        (sum(ref_losses) / len(ref_losses)).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, rp in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), rp, rtol=1e-5, atol=1e-6)
    return all(isinstance(p, DTensor) and not p.is_inference() for p in model.parameters())


@pytest.mark.parametrize("bucket_numel,raf", [(0, True), (10 ** 6, True), (0, False)],
                         ids=["units", "merged", "kept_gathered"])
def test_an_inference_mode_forward_then_training_matches_one_process(bucket_numel, raf):
    # torch's FSDP2 raises "Inplace update to inference tensor outside InferenceMode" here:
    # the buffers its first gather made under inference mode cannot be written later
    assert run_distributed(_inference_then_train_worker, 2, bucket_numel, raf) == [True, True]


def _exit_waits_for_the_last_collective():
    import time

    import torch.nn as nn

    from fullshard.core import comm

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    model[0](torch.randn(2, 4))  # a child's forward first, then the program would end
    waited = comm.settle_before_exit()  # what the exit handler does
    time.sleep(comm.GRACE_S)
    return comm._registered, 0 < waited <= comm.GRACE_S, comm.settle_before_exit() == 0.0


def test_exit_waits_until_the_collective_threads_let_go_of_their_tensors():
    """Note [collectives settle before exit]: a program that ends right after a
    collective waits (at most GRACE_S) before the interpreter finalizes; one that ends
    later does not wait."""
    assert run_distributed(_exit_waits_for_the_last_collective, 2) == [(True, True, True)] * 2
