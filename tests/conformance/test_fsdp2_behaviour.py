"""Behaviours torch's FSDP2 tests check, written from the behaviour, run on CPU/gloo.

Each is a parity test against a single-process reference or a check of what torch
does with the same call: module lists as one unit, torch's own policy objects,
torch.compile in both orders, the FSDPModule setters, copy/pickle, torch's
state-dict function keywords.
"""

from __future__ import annotations

import copy
import pickle
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

from torch.distributed.tensor import Shard

from fullshard import fully_shard
from fullshard import checkpoint as ckpt
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_forward_backward
from fullshard.testing.models import token_batch
from fullshard.testing.parity import check_parity
from fullshard.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=3, n_heads=2)


def _batch(step, n=4):
    return token_batch(step, n, CFG.vocab_size, CFG.seq_len)


def _loss(model, batch):
    return lm_loss(model(batch[0]), batch[1])


def _parity(shard, cfg=CFG, **kwargs):
    return check_parity(lambda: GPT(cfg), shard, _batch, _loss, **kwargs).max_weight_diff


# -- fully_shard arguments --------------------------------------------------------------------
def _list_unit_parity():
    def shard(model):
        for layer in model.layers:
            fully_shard(layer)
        out = fully_shard([model.ln_f, model.pos_emb], mp_policy=TorchMixedPrecisionPolicy(),
                          offload_policy=None)
        assert isinstance(out, list) and out[0] is model.ln_f
        fully_shard(model)
        model.set_bucket_numel(0)
    _parity(shard)
    # one all-gather serves both modules of the list
    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard([model.ln_f, model.pos_emb])
    fully_shard(model)
    model.set_bucket_numel(0)
    x, y = _batch(0, 2)
    fwd, _ = count_forward_backward(lambda: lm_loss(model(x), y))
    return sum(fwd.values())


@pytest.mark.slow
def test_a_list_of_modules_is_one_unit():
    gathers = run_distributed(_list_unit_parity, 2)[0]
    assert gathers == CFG.n_layers + 2  # layers, the list, the root


def _setting_on_a_list_member():
    world = dist.get_world_size()
    calls = []

    def shard(model):
        for layer in model.layers:
            fully_shard(layer)
        ln_f, _ = fully_shard([model.ln_f, model.pos_emb])
        # set on ln_f, which runs after pos_emb: it is the whole unit's setting, as with torch
        ln_f.set_gradient_divide_factor(2.0 * world)
        ln_f.set_all_reduce_hook(lambda grad: (calls.append(1), grad.mul_(2)))
        fully_shard(model)
    _parity(shard)
    return len(calls)


@pytest.mark.slow
def test_a_setting_on_one_module_of_a_list_applies_to_the_unit():
    assert run_distributed(_setting_on_a_list_member, 2)[0] == 5  # once per step


def _torch_policies_parity():
    def shard(model):
        policy = TorchMixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy, offload_policy=TorchCPUOffloadPolicy())
        fully_shard(model, mp_policy=policy, offload_policy=TorchCPUOffloadPolicy())
    _parity(shard)


@pytest.mark.slow
def test_torchs_policy_objects_are_accepted():
    run_distributed(_torch_policies_parity, 2)


def _on_dim_1(p):
    return Shard(1) if p.dim() >= 2 else None


class _Experts(nn.Module):
    """Expert weights (experts, in, out), e.g. sharded on dim 1 when experts < ranks."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(3, CFG.d_model, 8) * 0.1)
        self.down = nn.Parameter(torch.randn(3, 8, CFG.d_model) * 0.1)

    def forward(self, x):
        h = torch.einsum("btd,edh->ebth", x, self.up).relu()
        return x + torch.einsum("ebth,ehd->btd", h, self.down)


class _ExpertGPT(GPT):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.experts = _Experts()

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(self.experts(x)))


def _shard_dims(tmp):
    def shard(model):
        for layer in model.layers:
            fully_shard(layer, shard_placement_fn=_on_dim_1)
        fully_shard(model.experts, shard_placement_fn=lambda p: Shard(1 if p is model.experts.up
                                                                      else 2))
        fully_shard(model, shard_placement_fn=lambda p: Shard(-1) if p.dim() == 2 else None)
    torch.manual_seed(0)
    check_parity(lambda: _ExpertGPT(CFG), shard, _batch, _loss)
    torch.manual_seed(0)
    model = _ExpertGPT(CFG)
    shard(model)
    placements = {k: (v.placements, v.dim()) for k, v in model.state_dict().items()}
    # a checkpoint saved with these layouts loads into the default one (DCP reshards by
    # global offsets), and both train on alike
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model, _batch(0)).backward()
    opt.step()
    opt.zero_grad()
    ckpt.save(f"{tmp}/dims", model, opt)
    default = _ExpertGPT(CFG)
    for layer in default.layers:
        fully_shard(layer)
    fully_shard(default)
    opt2 = torch.optim.AdamW(default.parameters(), lr=1e-2)
    ckpt.load(f"{tmp}/dims", default, opt2)
    for m, o in ((model, opt), (default, opt2)):
        _loss(m, _batch(1)).backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), default.parameters()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), msg=name)
    return placements


@pytest.mark.slow
def test_shard_placement_fn_shards_on_other_dims(tmp_path):
    placements = run_distributed(_shard_dims, 2, str(tmp_path))[0]
    layer0 = {k: p for k, (p, ndim) in placements.items() if k.startswith("layers.0.")}
    assert layer0 and all(p == ((Shard(1),) if placements[k][1] >= 2 else (Shard(0),))
                          for k, p in layer0.items()), layer0
    assert placements["experts.up"][0] == (Shard(1),)
    assert placements["experts.down"][0] == (Shard(2),)
    assert placements["tok_emb.weight"][0] == (Shard(1),)


# -- torch.compile -----------------------------------------------------------------------------
def _compiled(order: str, backend: str) -> list[float]:
    torch.manual_seed(0)
    model = GPT(CFG)
    if order == "blocks_before":  # torchtitan: compile each block, then shard
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend=backend)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    run = torch.compile(model, backend=backend) if order == "model_after" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x, y = _batch(step, 2)
        x, y = x[dist.get_rank()::2], y[dist.get_rank()::2]
        loss = lm_loss(run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("order", ["blocks_before", "model_after"])
@pytest.mark.slow
def test_torch_compile_trains_with_the_eager_losses(order):
    eager = run_distributed(_compiled, 2, "none", "eager")[0]
    compiled = run_distributed(_compiled, 2, order, "aot_eager", timeout=300)[0]
    assert compiled == pytest.approx(eager, rel=1e-6)


@pytest.mark.skipif(shutil.which("cc") is None, reason="inductor needs a C compiler")
@pytest.mark.slow
def test_torch_compile_with_inductor():
    eager = run_distributed(_compiled, 2, "none", "eager")[0]
    compiled = run_distributed(_compiled, 2, "blocks_before", "inductor", timeout=600)[0]
    assert compiled == pytest.approx(eager, rel=1e-5)


# -- FSDPModule setters ------------------------------------------------------------------------
def _divide_factor_and_hook():
    world = dist.get_world_size()
    seen = []

    def shard(model):
        for layer in model.layers:
            fully_shard(layer)
            # sum over ranks, divided by 2*world: the reference's mean gradient, halved ...
            layer.set_gradient_divide_factor(2.0 * world)
            # ... and doubled back by the hook: training must match the reference exactly
            layer.set_all_reduce_hook(lambda grad: (seen.append(grad.numel()), grad.mul_(2)))
        fully_shard(model)
    _parity(shard)
    calls = len(seen)

    def factor_only(model):  # without the hook's doubling, the updates are halved
        for layer in model.layers:
            fully_shard(layer)
            layer.set_gradient_divide_factor(2.0 * world)
        fully_shard(model)
    with pytest.raises(AssertionError):
        _parity(factor_only)
    return calls


class _CountingAllGather:
    """torch's AllGather protocol: allocate, then gather (counts what it is given)."""

    def __init__(self):
        self.allocated, self.calls = [], 0

    def allocate(self, size, *, dtype, device):
        self.allocated.append(tuple(size))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


class _AllToAllReduceScatter(_CountingAllGather):
    """torch's ReduceScatter protocol, written with all_to_all (gloo has no reduce-scatter)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        assert op == dist.ReduceOp.SUM
        self.calls += 1
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(group.size(), -1), dim=0, out=output_tensor)


def _custom_comms():
    gathers, reductions = [], []

    def shard(model):
        for layer in model.layers:
            fully_shard(layer)
            gathers.append(_CountingAllGather())
            reductions.append(_AllToAllReduceScatter())
            layer.set_custom_all_gather(gathers[-1])
            layer.set_custom_reduce_scatter(reductions[-1])
        fully_shard(model)
    _parity(shard)
    world = dist.get_world_size()
    return ([(g.calls, len(set(g.allocated))) for g in gathers],
            [(r.calls, sorted({n for n, in r.allocated})) for r in reductions], world)


def test_custom_all_gather_and_reduce_scatter_train_as_the_built_in_ones():
    gathers, reductions, world = run_distributed(_custom_comms, 2)[0]
    # 5 steps: each layer gathered in forward and again in backward (resharded after
    # forward), reduced once per step; kept its own collective (not merged)
    assert [calls for calls, _ in gathers] == [10] * CFG.n_layers
    assert all(sizes == 1 for _, sizes in gathers)
    for calls, sizes in reductions:
        assert calls == 5
        assert len(sizes) == 2 and sizes[1] == world * sizes[0]  # output, rank-major input


def test_gradient_divide_factor_and_all_reduce_hook():
    calls = run_distributed(_divide_factor_and_hook, 2)[0]
    assert calls == 5 * CFG.n_layers  # once per layer per step


def _requires_all_reduce_hsdp():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    toggles = []

    def shard(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        toggles.append(model)

    def batch(i):  # micro-batch 0 without the replica all-reduce, 1 with it
        toggles[0].set_requires_all_reduce(i % 2 == 1)
        return _batch(i, 8)
    check_parity(lambda: GPT(CFG), shard, batch, _loss, micro_batches=2)
    shard_counts = []
    for flag in (False, True):
        toggles.clear()
        torch.manual_seed(0)
        model = GPT(CFG)
        shard(model)
        model.set_bucket_numel(0)
        model.set_requires_all_reduce(flag)
        x, y = _batch(0, 2)
        shard_counts.append(count_forward_backward(lambda: lm_loss(model(x), y))[1])
    return shard_counts


@pytest.mark.slow
def test_requires_all_reduce_false_accumulates_within_the_shard_group():
    without, with_ = run_distributed(_requires_all_reduce_hsdp, 4)[0]
    assert "all_reduce" not in without and without["reduce_scatter"] == CFG.n_layers + 1
    assert with_["all_reduce"] == CFG.n_layers + 1


class _EmbedThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(CFG.vocab_size, 16)
        self.out = nn.Linear(16, CFG.vocab_size)

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x)))


def _unshard_in_backward_false():
    def shard(model):
        fully_shard(model.emb)
        model.emb.set_unshard_in_backward(False)  # an embedding's backward reads no weight
        fully_shard(model)
        model.set_bucket_numel(0)
    report = check_parity(_EmbedThenLinear, shard, _batch, _loss)
    torch.manual_seed(0)
    model = _EmbedThenLinear()
    shard(model)
    x, y = _batch(0, 2)
    _, bwd = count_forward_backward(lambda: lm_loss(model(x), y))
    return report.max_weight_diff, bwd


def test_unshard_in_backward_false_gathers_nothing_in_backward():
    _, bwd = run_distributed(_unshard_in_backward_false, 2)[0]
    assert "all_gather" not in bwd and "all_gather_async" not in bwd  # the root stays gathered
    assert bwd["reduce_scatter"] == 2


def _reset_after_a_failed_forward():
    def shard(model):
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        # a forward that dies halfway (after the first two layers ran), then a reset
        x, _ = _batch(99, 2)
        broken = model.layers[2].forward
        model.layers[2].forward = lambda *a, **k: (_ for _ in ()).throw(ValueError("boom"))
        with pytest.raises(ValueError, match="boom"):
            model(x).sum().backward()
        model.layers[2].forward = broken
        model.reset_iter_state()
    return _parity(shard)


def test_reset_iter_state_after_a_failed_forward():
    run_distributed(_reset_after_a_failed_forward, 2)


def _reshard_after_forward_toggle():
    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.set_bucket_numel(0)
    x, y = _batch(0, 2)
    count_forward_backward(lambda: lm_loss(model(x), y))
    model.set_reshard_after_forward(False)
    _, kept = count_forward_backward(lambda: lm_loss(model(x), y))
    model.set_reshard_after_forward(True)  # the root too, as torch does
    _, freed = count_forward_backward(lambda: lm_loss(model(x), y))
    return kept, freed


def test_set_reshard_after_forward_at_run_time():
    kept, freed = run_distributed(_reshard_after_forward_toggle, 2)[0]
    assert "all_gather" not in kept and "all_gather_async" not in kept
    assert freed.get("all_gather", 0) + freed.get("all_gather_async", 0) == CFG.n_layers + 1


def _mixed_reshard_settings(merge: bool):
    settings = [True, False, 2, None]  # per block: ZeRO-3, ZeRO-2, hpZ to 2 ranks, default

    def shard(model):
        for layer, setting in zip(model.layers, settings):
            fully_shard(layer, reshard_after_forward=setting)
        fully_shard(model, reshard_after_forward=True)
        if not merge:
            model.set_bucket_numel(0)
    _parity(shard, cfg=GPTConfig(**{**CFG.__dict__, "n_layers": len(settings)}),
            micro_batches=2)


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.slow
def test_mixed_reshard_after_forward_settings_finish_and_match(merge):
    # one unit each way in one model, with gradient accumulation (two backwards a step)
    run_distributed(_mixed_reshard_settings, 4, merge, timeout=120)


# -- copy, pickle, torch's state-dict keywords -------------------------------------------------
def _copy_pickle_and_state_dict_keywords():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    torch.manual_seed(0)
    model = fully_shard(GPT(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(0, 2)
    lm_loss(model(x), y).backward()
    opt.step()
    errors = []
    for attempt in (lambda: copy.deepcopy(model), lambda: pickle.dumps(model)):
        with pytest.raises(TypeError) as err:
            attempt()
        errors.append(str(err.value))
    msd, osd = ckpt.get_state_dict(model, optimizers=opt,
                                   options=StateDictOptions(full_state_dict=False))
    ckpt.set_state_dict(model, optimizers=opt, model_state_dict=msd, optim_state_dict=osd)
    full = ckpt.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    ckpt.set_model_state_dict(model, model_state_dict=full,
                              options=StateDictOptions(full_state_dict=True))
    ckpt.set_optimizer_state_dict(model, optimizers=opt, optim_state_dict=osd)
    return errors


def test_copy_and_pickle_say_to_use_a_state_dict_and_torchs_keywords_work():
    errors = run_distributed(_copy_pickle_and_state_dict_keywords, 2)[0]
    assert all("is not supported" in e and "state_dict()" in e for e in errors), errors
