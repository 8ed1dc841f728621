"""Ranks that see different data take different paths, and still train as one process.

An expert that gets no tokens on one rank, a branch taken on some ranks only, a parameter
of the root used by some ranks: every rank reduces the same units in the same order
(Note [when a unit's backward is done]) and the result is a single-process run's. Where
ranks differ in which *modules* run (a layer dropped on one rank, a unit whose output one
rank ignores), every rank raises one DivergenceError naming it, in bounded time (Note
[ranks agree on every collective]).

The reference is one process training on every rank's batch: its loss is the mean of the
per-rank losses (the load-balancing loss is a per-batch statistic, so it is computed per
rank's batch there too), which is the objective data-parallel training optimizes.
"""

from __future__ import annotations

import copy
import os
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import fully_shard
from fullshard.gpt import GPT, GPTConfig, gpt_loss, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.parity import assert_same_weights, full_value
from support.catalogue import matches_documented

# 8 experts, top 2, 3 tokens per rank: an expert gets no token on a rank ~40% of the time
MOE = GPTConfig(vocab_size=48, seq_len=3, d_model=32, n_layers=3, n_heads=2, n_experts=8,
                top_k=2, aux_loss_coef=0.05)
STEPS = 4


def _tokens(step: int, world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randint(0, MOE.vocab_size, (1, MOE.seq_len), generator=gen)
            for _ in range(world)]


class _Skipped:
    """Which (step, block, expert) got no token on this rank."""

    def __init__(self, model: nn.Module):
        self.step = 0
        self.ran: set = set()
        self.all: set = set()
        for b, block in enumerate(model.layers):
            for e, expert in enumerate(block.mlp.experts):
                self.all.add((b, e))
                expert.register_forward_pre_hook(partial(self._ran, b, e))
        self.skipped: set = set()

    def _ran(self, b, e, *_):
        self.ran.add((b, e))

    def end_step(self):
        self.skipped |= {(self.step, b, e) for b, e in self.all - self.ran}
        self.ran, self.step = set(), self.step + 1


def _train(model, shard, steps=STEPS, micro_batches=1, lr=0.05, loss_of=gpt_loss,
           tokens=_tokens, rtol=1e-5, atol=None) -> dict:
    """Train ``model`` sharded by ``shard`` beside a one-process reference; returns the
    skipped experts (when ``model`` has them) and the largest weight difference. ``rtol``
    loosens the comparison for numerics that differ by design (int8, bf16)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = copy.deepcopy(model)
    watch = _Skipped(model) if isinstance(model, GPT) and model.cfg.n_experts else None
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        for micro in range(micro_batches):
            batch = tokens(step * micro_batches + micro, world)
            sync = micro == micro_batches - 1
            if micro_batches > 1:
                model.set_requires_gradient_sync(sync)
            loss = loss_of(model, batch[rank], batch[rank])
            loss.backward()
            ref_losses = [loss_of(reference, x, x) for x in batch]
            (sum(ref_losses) / world).backward()
            mean = loss.detach().float()
            dist.all_reduce(mean)
            torch.testing.assert_close(mean / world, sum(ref_losses).detach() / world,
                                       rtol=rtol, atol=atol or rtol / 10)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if watch is not None:
            watch.end_step()
    diff = _same_weights(model, reference, rtol, atol)
    return {"skipped": watch.skipped if watch else set(), "diff": diff}


def _blocks(model, **kwargs):
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model.set_bucket_numel(0)  # one collective per block: a misordered pair would show


def _moe_parity() -> dict:
    torch.manual_seed(0)
    return _train(GPT(MOE), _blocks)


def _partly_skipped(results: list[dict]) -> set:
    """(step, block, expert) that got no token on some ranks but not on all."""
    everywhere = set.intersection(*(r["skipped"] for r in results))
    return set.union(*(r["skipped"] for r in results)) - everywhere


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.slow
def test_experts_without_tokens_on_some_ranks_train_like_one_process(world):
    results = run_distributed(_moe_parity, world)
    assert _partly_skipped(results), "no expert was left without tokens on one rank only"


# -- a branch inside a block, a parameter of the root used on some ranks --------------------
class _Branchy(nn.Module):
    """Blocks that take one of two branches by the sign of their input's mean; a root
    parameter (``extra``) used only when the input's first token id is even."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(48, 16)
        self.extra = nn.Linear(16, 16)
        self.layers = nn.ModuleList(_Branch() for _ in range(3))
        self.head = nn.Linear(16, 48)

    def forward(self, idx):
        x = self.emb(idx)
        if int(idx[0, 0]) % 2 == 0:
            x = x + self.extra(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 16)
        self.down = nn.Linear(16, 16)

    def forward(self, x):
        return x + (self.up(x) if x.mean() > 0 else self.down(x).relu())


def _branch_loss(model, x, y):
    return lm_loss(model(x), y)


def _branch_tokens(step, world):
    gen = torch.Generator().manual_seed(7 + step)
    return [torch.randint(0, 48, (2, 5), generator=gen) for _ in range(world)]


def _branch_parity() -> dict:
    torch.manual_seed(0)
    return _train(_Branchy(), _blocks, steps=5, loss_of=_branch_loss, tokens=_branch_tokens)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_branches_and_root_parameters_used_on_some_ranks_train_like_one_process(world):
    run_distributed(_branch_parity, world)


# -- combinations ------------------------------------------------------------------------
def _zero1(model):
    _blocks(model, reshard_after_forward=False)
    model.set_keep_unsharded_storage(True)


def _checkpointed(model, reentrant: bool):
    """Blocks checkpointed, then sharded. The reference is checkpointed too: reentrant
    checkpointing runs the forward without grad, so the load-balancing loss (a side
    output) gets no gradient there either."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=impl)
    return model


def _offloaded(model, tmp):
    from fullshard import CPUOffloadPolicy, DiskOffloadPolicy
    policy = CPUOffloadPolicy() if tmp is None else DiskOffloadPolicy(path=tmp)
    _blocks(model, offload_policy=policy)


def _merged(model):
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)  # the default: small blocks merged into shared collectives


def _unused_as_zeros(model):
    _blocks(model)
    model.set_reduce_scatter_unused_params(True)


def _freeze_expert_inputs(model):
    """Frozen weights inside the units (a base under adapters): each expert's first layer.
    The unit's backward is over only once its input gradients, which read them, are done."""
    for block in model.layers:
        for expert in block.mlp.experts:
            expert.fc.weight.requires_grad_(False)
    return model


# name: (shard function, micro-batches); each trains like one process (SGD, fp32)
COMBOS = {
    "frozen weights in the experts": (_blocks, 1),
    "merged units": (_merged, 1),
    "reshard_after_forward=False": (partial(_blocks, reshard_after_forward=False), 1),
    "zero1": (_zero1, 1),
    "accumulation without sync": (_blocks, 2),
    "checkpointing, non-reentrant": (_blocks, 1),
    "checkpointing, reentrant": (_blocks, 1),
    "cpu offload": (partial(_offloaded, tmp=None), 1),
    "unused as zeros": (_unused_as_zeros, 1),
}


def _combos(names: list[str], tmp: str | None) -> dict:
    out = {}
    for name in names:
        shard, micro = COMBOS[name] if name != "disk offload" else (
            partial(_offloaded, tmp=tmp), 1)
        torch.manual_seed(0)
        model = GPT(MOE)
        if name.startswith("checkpointing"):
            model = _checkpointed(model, reentrant=name.endswith(", reentrant"))
        if name.startswith("frozen"):
            model = _freeze_expert_inputs(model)
        if name == "unused as zeros":  # zeros for unused-everywhere parameters: plain SGD
            out[name] = _train_no_momentum_equal(model, shard)
            continue
        try:
            out[name] = _train(model, shard, micro_batches=micro)["diff"]
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
    return out


def _train_no_momentum_equal(model, shard) -> float:
    """With zero gradients for experts nobody used, plain SGD (no momentum, no decay)
    still matches one process; the gradients exist (zeros) where one process has None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = copy.deepcopy(model)
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    zero_grads = 0
    for step in range(STEPS):
        batch = _tokens(step, world)
        gpt_loss(model, batch[rank], batch[rank]).backward()
        (sum(gpt_loss(reference, x, x) for x in batch) / world).backward()
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert all(p.grad is not None for p in trainable), "a trainable parameter has no grad"
        zero_grads += sum(q.grad is None for q in reference.parameters())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    assert zero_grads, "no expert went unused on every rank: the case is not exercised"
    return _same_weights(model, reference, 1e-5)


def _same_weights(model, reference, rtol: float, atol: float | None = None) -> float:
    """``assert_same_weights`` with checkpoint wrappers' names unwrapped."""
    def unwrapped(module):
        return SimpleNamespace(named_parameters=lambda: (
            (name.replace("._checkpoint_wrapped_module", ""), p)
            for name, p in module.named_parameters()))
    return assert_same_weights(unwrapped(model), unwrapped(reference), rtol=rtol,
                               atol=atol or rtol / 10)


def _against_torch() -> dict:
    """torch's FSDP2 and fullshard, both with set_reduce_scatter_unused_params(True), on
    the same model and batches (SGD with momentum: a zero gradient moves the momentum
    where None would not)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ours = GPT(MOE)
    theirs = copy.deepcopy(ours)
    _unused_as_zeros(ours)
    for layer in theirs.layers:
        torch_fully_shard(layer)
    torch_fully_shard(theirs)
    theirs.set_reduce_scatter_unused_params(True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    for step in range(STEPS):
        x = _tokens(step, world)[rank]
        for model, opt in zip((ours, theirs), opts):
            gpt_loss(model, x, x).backward()
        none = [[p.grad is None for p in m.parameters()] for m in (ours, theirs)]
        assert none[0] == none[1], "fullshard and torch differ in which gradients are None"
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(full_value(p.detach()), full_value(q.detach()), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return {"skipped": set()}


@pytest.mark.slow
def test_unused_as_zeros_trains_as_torch_fsdp2_does():
    from torch.distributed.fsdp import FSDPModule
    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):  # torch 2.11
        pytest.skip(f"torch {torch.__version__}'s FSDP2 has no set_reduce_scatter_unused_params "
                    "to compare with")
    run_distributed(_against_torch, 2)


class _QuantizedExperts(nn.Module):
    """A block of QLoRA experts (frozen int8 tensor-subclass bases gathered in their own
    form, trainable adapters) behind a softmax router, top-1."""

    def __init__(self):
        from support.quantized_weights import D, QLoRALinear
        super().__init__()
        self.router = nn.Linear(D, 4)
        self.experts = nn.ModuleList(QLoRALinear("int8", D, D) for _ in range(4))

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        chosen = probs.argmax(-1)
        out = torch.zeros_like(x)
        self.idle = set()
        for e, expert in enumerate(self.experts):
            token = torch.where(chosen == e)[0]
            if token.numel():
                out = out.index_add(0, token, expert(x[token]) * probs[token, e, None])
            else:
                self.idle.add(e)
        return x + out


def _quantized_experts_parity() -> float:
    from support.quantized_weights import D
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(_QuantizedExperts(), _QuantizedExperts())
    reference = copy.deepcopy(model)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    model.set_bucket_numel(0)
    params = [[p for p in m.parameters() if p.requires_grad] for m in (model, reference)]
    opt, ref_opt = (torch.optim.SGD(p, lr=0.05, momentum=0.9) for p in params)
    idle = set()
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        xs = [torch.randn(3, D, generator=gen) for _ in range(world)]
        model(xs[rank]).square().mean().backward()
        idle |= {(step, b, e) for b, block in enumerate(model) for e in block.idle}
        (sum(reference(x).square().mean() for x in xs) / world).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(params[0], params[1]):
        torch.testing.assert_close(full_value(p.detach()), q.detach(), rtol=1e-5, atol=1e-6)
    return {"skipped": idle}


@pytest.mark.slow
def test_quantized_tensor_subclass_experts_train_like_one_process():
    assert _partly_skipped(run_distributed(_quantized_experts_parity, 2))


@pytest.mark.slow
def test_every_combination_trains_like_one_process(tmp_path):
    names = [*COMBOS, "disk offload"]
    results = run_distributed(_combos, 2, names, str(tmp_path), timeout=300)
    for name in names:
        assert results[0][name] < 1e-4, (name, results[0][name])


def _compiled(model):
    for layer in model.layers:
        layer.compile()  # compiled, then sharded: the hooks run eagerly between graphs
    _blocks(model)


def _compiled_parity() -> dict:
    torch.manual_seed(0)
    return _train(GPT(MOE), _compiled)


@pytest.mark.extended
def test_compiled_blocks_with_rank_dependent_experts_train_like_one_process():
    results = run_distributed(_compiled_parity, 2, timeout=600)
    assert _partly_skipped(results)


def _hybrid(model):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _blocks(model, mesh=mesh)


def _quantized(model):
    _blocks(model)
    model.set_quantized_communication(weights=True, grads=True)


def _bf16(model):
    from fullshard import MixedPrecisionPolicy
    _blocks(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32))


# name: (shard function, rtol, atol): at 4 ranks; int8 and bf16 differ from fp32 by design
# (int8: one scale per 256 elements rounds small gradient entries by up to ~1e-2; bf16:
# 8-bit mantissas against an fp32 reference). What they check here is that ranks whose
# experts differ reduce in step: a misordered pair would be off by whole gradients.
COMBOS_4 = {
    "hpZ (reshard_after_forward=2)": (partial(_blocks, reshard_after_forward=2), 1e-5, None),
    "hybrid sharding (2 x 2)": (_hybrid, 1e-5, None),
    "int8 communication": (_quantized, 5e-2, 3e-2),
    "bf16 parameters, fp32 reduction": (_bf16, 5e-2, 3e-2),
}


def _combos_4() -> dict:
    out = {}
    for name, (shard, rtol, atol) in COMBOS_4.items():
        torch.manual_seed(0)
        try:
            result = _train(GPT(MOE), shard, rtol=rtol, atol=atol)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
        out[name] = (result["diff"], result["skipped"])
    return out


@pytest.mark.slow
@pytest.mark.extended
def test_every_combination_at_four_ranks_trains_like_one_process():
    results = run_distributed(_combos_4, 4, timeout=300)
    for name in COMBOS_4:  # the weights were compared on every rank, inside
        assert _partly_skipped([{"skipped": r[name][1]} for r in results]), name


# -- modules that run on some ranks only: one named error on every rank, in bounded time --
DENSE = GPTConfig(vocab_size=48, seq_len=4, d_model=16, n_layers=4, n_heads=2)


def _dense_model():
    os.environ["FULLSHARD_ARRIVAL_TIMEOUT"] = "10"  # stalls are compared after 1 s
    torch.manual_seed(0)
    model = GPT(DENSE)
    _blocks(model)
    return model


def _drop_layer_on_rank1(at_step: int):
    """Layer drop: rank 1 skips layers.1 from ``at_step`` on (0: the very first forward,
    before any order is known for prefetching)."""
    model = _dense_model()
    x = torch.randint(0, DENSE.vocab_size, (2, DENSE.seq_len))
    for step in range(3):
        if step == at_step and dist.get_rank() == 1:
            model.layers[1] = nn.Identity()
        lm_loss(model(x), x).backward()


@pytest.mark.parametrize("world, at_step", [(2, 0), (2, 2), (3, 2)],
                         ids=["2 ranks, first step", "2 ranks, later step", "3 ranks"])
@pytest.mark.slow
def test_a_layer_dropped_on_one_rank_is_named_on_every_rank(world, at_step):
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_distributed(_drop_layer_on_rank1, world, at_step, timeout=120)
    text = str(failure.value)
    assert time.monotonic() - started < 60, text[-2000:]
    assert f"{world} of {world} ranks failed" in text, text[-3000:]
    if at_step == 0:  # the models differ before their first collective: named as such
        assert text.count("rank 0 has unit #2 'layers.1' where rank 1 has unit #2 "
                          "'layers.2'") == world, text[-3000:]
        assert matches_documented("E260", _raised(text)), _raised(text)
        return
    assert text.count(f"ranks diverged at step {at_step} (forward, entry #") == world, \
        text[-3000:]
    others = "rank 0" if world == 2 else "ranks 0, 2"
    assert text.count(f"{others} ran the forward of 'layers.1'") == world, text[-3000:]
    assert text.count("rank 1 ran the forward of 'layers.2'") == world, text[-3000:]
    assert matches_documented("E29", _raised(text)), _raised(text)


class _Parallel(nn.Module):
    """Three same-shaped units on one input; the loss may leave one out."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(48, 16)
        self.branches = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, idx, use):
        x = self.emb(idx)
        return sum(b(x) for i, b in enumerate(self.branches) if i in use) + sum(
            0 * b(x).detach() for i, b in enumerate(self.branches) if i not in use)


def _output_unused_on_rank1():
    """Every unit runs its forward everywhere, but rank 1's loss does not use branches.2:
    its backward never reaches that unit, whose reduction then comes last there and in
    place elsewhere. Same sizes: without the check the pair would sum the wrong units."""
    os.environ["FULLSHARD_ARRIVAL_TIMEOUT"] = "10"
    torch.manual_seed(0)
    model = _Parallel()
    for branch in model.branches:
        fully_shard(branch)
    fully_shard(model)
    model.set_bucket_numel(0)
    idx = torch.randint(0, 48, (2, 3))
    use = {0, 1} if dist.get_rank() == 1 else {0, 1, 2}
    model(idx, use).square().mean().backward()


@pytest.mark.slow
def test_reductions_in_different_orders_are_named_before_the_optimizer_sees_them():
    with pytest.raises(AssertionError) as failure:
        run_distributed(_output_unused_on_rank1, 2, timeout=120)
    text = str(failure.value)
    assert text.count("DivergenceError: fullshard: ranks diverged at step 0 (backward") == 2, \
        text[-3000:]
    # rank 1 has moved on (to gathering branches.0 for its backward) where rank 0 reduces
    assert text.count("rank 0 ran the reduce-scatter of 'branches.2' (backward of step 0); "
                      "rank 1 ran the ") == 2, text[-3000:]


def _slow_rank_1():
    """Rank 1 is busy for 4 s before its forward (a slow data loader, a save of its own):
    rank 0 stalls in its first all-gather, compares after each 1 s slice, finds rank 1
    merely behind, and waits on; both then train normally."""
    model = _dense_model()
    x = torch.randint(0, DENSE.vocab_size, (2, DENSE.seq_len))
    for step in range(2):
        if dist.get_rank() == 1 and step == 1:
            time.sleep(4)
        lm_loss(model(x), x).backward()
    return True


@pytest.mark.slow
def test_a_rank_that_is_only_slow_is_waited_for():
    assert run_distributed(_slow_rank_1, 2, timeout=120) == [True, True]


def _raised(report: str) -> str:
    start = report.index("DivergenceError: ")
    end = report.find("\n", start)
    return report[start:end].strip()
