"""The training loop's options at world size 2, in-process through the test harness, and
how its micro-batches reach the GPU, the learning-rate schedule and the step skipped on a
non-finite gradient norm."""

import pytest
import torch

from fullshard.testing import run_distributed
from fullshard.train.config.schema import ConfigError, OptimConfig
from fullshard.train.loop import Trainer, learning_rate, on_device, step_or_skip
from support.catalogue import matches_documented
from support.train_runs import assert_resumed_exactly, straight_and_resumed, train_losses

def _variants(variants: dict[str, dict]) -> dict[str, list[float]]:
    return {name: train_losses(overrides) for name, overrides in variants.items()}


@pytest.mark.slow
def test_strategies_accumulation_and_recomputation_train_the_same_model(tmp_path):
    """Every strategy computes the same averaged gradient; 2 micro-batches of 2 are the
    4 sequences of one batch of 4; recomputed activations are the stored ones; CPU
    offload, with the optimizer states in memory or on disk, computes on the host what
    the devices compute."""
    states = tmp_path
    variants = {
        "full_shard": {"batch.batch_size": 4},
        "shard_grad_op": {"batch.batch_size": 4, "parallel.strategy": "shard_grad_op"},
        "zero1": {"batch.batch_size": 4, "parallel.strategy": "zero1"},
        "hybrid_shard": {"batch.batch_size": 4, "parallel.strategy": "hybrid_shard"},
        "no_shard": {"batch.batch_size": 4, "parallel.strategy": "no_shard"},
        "checkpointed": {"batch.batch_size": 4, "parallel.activation_checkpointing": True},
        "accumulated": {"batch.batch_size": 2, "batch.grad_accum": 2},
        "hpz": {"batch.batch_size": 4, "parallel.reshard_after_forward": 2},
        "offloaded": {"batch.batch_size": 4, "parallel.offload": True},
        "states_on_disk": {"batch.batch_size": 4, "parallel.offload": f"disk:{states}"},
        "params_on_disk": {"batch.batch_size": 4, "parallel.offload": f"disk:{states}",
                           "parallel.offload_params": True},
        # the disk step inside the optimizer step, not on the host thread (overlap_step)
        "states_on_disk_in_step": {"batch.batch_size": 4, "parallel.offload": f"disk:{states}",
                                   "parallel.overlap_step": False},
    }
    losses = run_distributed(_variants, 2, variants)[0]
    assert losses["states_on_disk"] == losses["states_on_disk_in_step"]  # to the bit
    reference = losses.pop("full_shard")
    assert len(reference) == 4 and reference[-1] < reference[0]
    for name, got in losses.items():
        assert got == pytest.approx(reference, rel=1e-5, abs=1e-6), name


@pytest.mark.slow
@pytest.mark.extended
def test_compiled_blocks_train_the_eager_model():
    """--parallel.compile: each block one inductor graph between the hooks; the losses
    are the eager ones up to the compiler's reassociation."""
    variants = {"eager": {}, "compiled": {"parallel.compile": True}}
    losses = run_distributed(_variants, 2, variants)[0]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4)


@pytest.mark.slow
def test_bf16_and_fp16_train_close_to_fp32():
    variants = {p: {"parallel.precision": p, "steps": 6} for p in ("fp32", "bf16", "fp16")}
    losses = run_distributed(_variants, 2, variants)[0]
    for precision in ("bf16", "fp16"):
        assert losses[precision][-1] < losses[precision][0]
        assert losses[precision] == pytest.approx(losses["fp32"], abs=0.05), precision


def _config_error(overrides: dict) -> str:
    try:
        train_losses(overrides)
    except ConfigError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_data_dependent_errors_name_the_field():
    errors = run_distributed(_config_error, 2, {"gpt.vocab_size": 40})
    assert errors[0] == errors[1]
    assert "gpt.vocab_size: the data has 65 distinct characters, more than 40" in errors[0]
    errors = run_distributed(_config_error, 2, {"parallel.strategy": "hybrid_shard",
                                                "parallel.replicas": 3})
    assert "parallel.replicas: 3 does not divide the world size 2" in errors[0]


def test_symmetric_memory_where_it_cannot_work_names_the_flag():
    """--parallel.symm_mem true on CPU (gloo, a CPU torch): every rank refuses before any
    collective, naming the flag, instead of training without it."""
    errors = run_distributed(_config_error, 2, {"parallel.symm_mem": True})
    assert errors[0] == errors[1]
    assert errors[0].startswith("parallel.symm_mem: true cannot work here ("), errors[0]
    assert matches_documented("E304", f"ConfigError: {errors[0]}"), errors[0]



@pytest.mark.slow
def test_quantized_communication_trains_within_a_percent_of_full_precision():
    """--parallel.quantize weights,grads: int8 all-gathers and reduce-scatters; the
    debug preset's losses stay within 1% of the full-precision run's at every step."""
    variants = {"full": {"steps": 20}, "int8": {"steps": 20, "parallel.quantize": "weights,grads"}}
    losses = run_distributed(_variants, 2, variants)[0]
    assert len(losses["full"]) == 20
    for a, b in zip(losses["int8"], losses["full"]):
        assert a == pytest.approx(b, rel=1e-2), (losses["int8"], losses["full"])


@pytest.mark.slow
@pytest.mark.extended
def test_moe_preset_trains_like_one_process():
    """--preset moe (stacked expert MLPs, top-2 routing, a load-balancing loss): 2
    ranks of one 4-token sequence each are one process accumulating the same 2 micro-
    batches (each rank's and each micro-batch's load-balancing loss is its own batch's).
    With 8 assignments per rank, an expert often gets no token on one rank only."""
    small = {"steps": 6, "batch.batch_size": 1, "batch.seq_len": 4}
    two = run_distributed(train_losses, 2, small, "moe")[0]
    one = run_distributed(train_losses, 1, {**small, "batch.grad_accum": 2}, "moe")[0]
    assert len(two) == 6
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)


def _muon_resume(out: str) -> dict:
    """--optim.name muon: 6 steps straight, and 3 steps then a resume to 6 (Muon's momentum
    buffers through the checkpoint): the same losses."""
    runs, trainer = straight_and_resumed(out, {"optim.name": "muon", "batch.batch_size": 2})
    return {"runs": runs, "optimizers": [type(o).__name__ for o in trainer.optimizers]}


@pytest.mark.slow
def test_muon_trains_and_resumes_exactly(tmp_path):
    out = run_distributed(_muon_resume, 2, str(tmp_path))[0]
    assert out["optimizers"] == ["Muon", "AdamW"]
    assert_resumed_exactly(out["runs"])


class _HostBatch:
    def __init__(self, calls):
        self.calls = calls

    def pin_memory(self):
        self.calls.append("pin_memory")
        return self

    def to(self, device, non_blocking=False):
        self.calls.append(("to", str(device), non_blocking))
        return self


def test_micro_batches_reach_the_gpu_through_pinned_memory_without_blocking():
    calls = []
    on_device([_HostBatch(calls), _HostBatch(calls)], torch.device("cuda", 1))
    assert calls == ["pin_memory", ("to", "cuda:1", True)] * 2
    x = torch.ones(2)
    assert on_device([x], torch.device("cpu"))[0] is x


def test_the_step_statistics_reach_the_device_through_pinned_memory(monkeypatch):
    """The host figures of _gather_stats go through on_device (pinned, non-blocking), not
    a non-blocking copy from pageable memory, which waits for the whole step's kernels."""
    from types import SimpleNamespace

    from fullshard.testing.fake_world import fake_world
    from fullshard.train import loop

    moved = []

    def spy(tensors, device):
        moved.append((tuple(t.tolist() for t in tensors), device))
        return on_device(tensors, device)

    monkeypatch.setattr(loop, "on_device", spy)
    cpu = torch.device("cpu")
    trainer = SimpleNamespace(worker=SimpleNamespace(device=cpu, world=1),
                              stop=SimpleNamespace(requested=True),
                              memory=SimpleNamespace(step_figures=lambda: [7, 9]))
    with fake_world(1):
        stats = Trainer._gather_stats(trainer, torch.tensor(2.5), torch.tensor(0.5), peaks=True)
    assert moved == [(([1.0, 7.0, 9.0],), cpu)]
    assert (stats.loss, stats.grad_norm, stats.stopping) == (2.5, 0.5, True)
    assert stats.figures.tolist() == [7.0, 9.0] and stats.peaks == [7]


def test_learning_rate_warms_up_then_follows_the_cosine_to_min_lr():
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)
    assert learning_rate(5, optim) == pytest.approx(0.5)
    assert learning_rate(10, optim) == pytest.approx(1.0)
    assert learning_rate(60, optim) == pytest.approx(0.55)  # half way: the mean
    assert learning_rate(110, optim) == pytest.approx(0.1)
    assert learning_rate(500, optim) == pytest.approx(0.1)
    rates = [learning_rate(s, optim) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_with_a_non_finite_gradient_norm_leaves_weights_and_states_alone(fused):
    """The trainer's step_or_skip: a fused AdamW skips on the device (no host read of the
    norm), any other optimizer after reading it; a finite norm steps."""
    weight = torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=fused, foreach=None if fused else False)
    weight.grad = torch.full((8,), 0.5)
    step_or_skip(optimizer, torch.tensor(1.0))
    after_one = weight.detach().clone()
    assert not torch.equal(after_one, torch.ones(8))
    states = {k: v.clone() for k, v in optimizer.state[weight].items()}
    for bad in (float("nan"), float("inf")):
        weight.grad = torch.full((8,), bad)
        step_or_skip(optimizer, torch.tensor(bad))
        assert torch.equal(weight.detach(), after_one)
        for k, v in optimizer.state[weight].items():
            assert torch.equal(v, states[k]), k  # the step count too
    weight.grad = torch.full((8,), 0.5)
    step_or_skip(optimizer, torch.tensor(1.0))
    assert float(optimizer.state[weight]["step"]) == 2.0
    assert not torch.equal(weight.detach(), after_one)


def test_a_clip_coefficient_given_to_the_fused_step_clips_as_clipping_first_does():
    """Note [the clip applied inside the step]: the weights within fp32 rounding of
    clipping ``.grad`` first, and the gradient the step leaves is the clipped one."""
    torch.manual_seed(0)
    grad = torch.randn(64)
    first, inside = (torch.nn.Parameter(torch.ones(64)) for _ in range(2))
    opts = [torch.optim.AdamW([w], lr=0.1, fused=True) for w in (first, inside)]
    for step in range(5):
        first.grad, inside.grad = grad * (step + 1), grad * (step + 1)
        norm = torch.linalg.vector_norm(first.grad)
        coef = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
        first.grad.mul_(coef)
        step_or_skip(opts[0], norm)
        step_or_skip(opts[1], norm, coef)
        torch.testing.assert_close(inside.grad, first.grad, rtol=1e-6, atol=0)
        assert opts[1].grad_scale is None  # never left for a later step
    torch.testing.assert_close(inside.detach(), first.detach(), rtol=1e-6, atol=0)
    assert not torch.equal(first.detach(), torch.ones(64))
    with pytest.raises(ValueError, match="only a fused optimizer"):
        step_or_skip(torch.optim.AdamW([first], lr=0.1, foreach=False), norm, coef)


def _offloaded_clipped_resume(out: str) -> dict:
    """--parallel.offload cpu with a clip that bites: 6 steps straight, and 3 steps then a
    resume to 6; the trainer's clip multiplies no gradient (Note [the clip applied
    inside the step])."""
    real, multiplied = torch._foreach_mul_, []

    def counted(tensors, scalar):
        multiplied.append(len(tensors))
        return real(tensors, scalar)

    torch._foreach_mul_ = counted
    try:
        runs, _ = straight_and_resumed(out, {"parallel.offload": "cpu", "optim.grad_clip": 0.05},
                                       read=lambda r: (r["loss"], r["grad_norm"]))
    finally:
        torch._foreach_mul_ = real
    return {"runs": runs, "multiplied": multiplied}


@pytest.mark.slow
def test_an_offloaded_clipped_run_resumes_exactly_with_the_clip_inside_the_step(tmp_path):
    out = run_distributed(_offloaded_clipped_resume, 2, str(tmp_path))[0]
    straight, resumed = out["runs"]["straight"], out["runs"]["resumed"]
    assert len(straight) == 6 and all(norm > 0.05 for _, norm in straight)  # clipped
    assert resumed[-3:] == straight[-3:]
    assert out["multiplied"] == []
