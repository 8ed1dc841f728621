"""CUDA lane: fully_shard over NCCL against single-process references on the same GPU.

One rank per visible GPU. On a one-GPU machine each rank function turns fullshard's
one-rank shortcuts off (``collectives_at_one_rank``), so the NCCL gathers and
reductions, the copy stream, its events and the pooled buffers run on the one rank;
CPU offload runs both ways (with the shortcuts: the copy-in alone, on the copy stream). Every rank
trains a sharded model on its share of each batch and a reference on the whole batch,
both on its GPU (fullshard.testing.check_parity).
"""

import lanes

lanes.require_cuda_lane()

import pytest  # noqa: E402 - only once the lane is known to run
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: E402
from fullshard.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from fullshard.testing import (collectives_at_one_rank, rank_device,  # noqa: E402
                               run_distributed, visible_gpus)
from fullshard.testing.models import token_batch  # noqa: E402
from fullshard.testing.parity import cast_reference_step, check_parity  # noqa: E402

WORLD = visible_gpus()
CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=2, n_heads=4)
# fp32 on a GPU: cuBLAS chooses kernels by shape, so a rank's share of a batch and the
# reference's whole batch may round differently (the CPU lane's 1e-5 / 1e-6 assume one
# kernel for both).
RTOL, ATOL = 1e-4, 1e-5


def _batch(step):
    return [t.to(rank_device()) for t in token_batch(step, 4 * WORLD, CFG.vocab_size,
                                                    CFG.seq_len)]


def _loss(model, batch):
    return lm_loss(model(batch[0]), batch[1])


def _gpt():
    return GPT(CFG).to(rank_device())


def _shard_each_layer(**options):
    def shard(model):
        for layer in model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
    return shard


def _fp32_parity():
    collectives_at_one_rank()  # one GPU: the gathers and reductions run, not shortcuts
    shard = _shard_each_layer()
    seen = {}

    def shard_and_look(model):
        shard(model)
        seen["shards"] = {p.to_local().device.type for p in model.parameters()}
    report = check_parity(_gpt, shard_and_look, _batch, _loss, steps=5, optimizer="adamw",
                          lr=1e-3, rtol=RTOL, atol=ATOL)
    return seen["shards"], dist.get_backend(), report.max_weight_diff


def test_fp32_training_matches_the_reference_on_the_same_gpu():
    for devices, backend, _ in run_distributed(_fp32_parity, WORLD, backend="nccl"):
        assert devices == {"cuda"} and backend == "nccl"


def _bf16_params_fp32_reduce():
    """The reference applies the same casts: fp32 master weights, a bf16 copy for forward
    and backward on the whole batch, fp32 gradients into SGD."""
    collectives_at_one_rank()  # one GPU: the gathers and reductions run, not shortcuts
    import copy

    rank, dev = dist.get_rank(), rank_device()
    torch.manual_seed(0)
    master = _gpt()
    model = copy.deepcopy(master)
    _shard_each_layer(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float32))(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(master.parameters(), lr=0.05, momentum=0.9)
    dtypes = set()
    for step in range(6):
        x, y = _batch(step)
        local = slice(4 * rank, 4 * rank + 4)
        loss = _loss(model, (x[local], y[local]))
        dtypes.add(("loss", loss.dtype))
        loss.backward()
        dtypes |= {("grad", p.grad.dtype) for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        ref_loss = cast_reference_step(master, ref_opt, lambda low: _loss(low, (x, y)),
                                       torch.bfloat16)
        mean = loss.detach().float()
        dist.all_reduce(mean)
        assert abs(mean.item() / WORLD - ref_loss.float().item()) <= \
            2e-2 * ref_loss.float().item(), (step, mean.item() / WORLD, ref_loss.item())
    for p, q in zip(model.parameters(), master.parameters()):
        assert isinstance(p, DTensor) and p.dtype == torch.float32 and p.device == dev
        torch.testing.assert_close(p.full_tensor(), q, rtol=0.05, atol=5e-3)
    return sorted(f"{what} {dtype}" for what, dtype in dtypes)


def test_bf16_parameters_with_fp32_reduction_match_a_reference_with_the_same_casts():
    for dtypes in run_distributed(_bf16_params_fp32_reduce, WORLD, backend="nccl"):
        assert dtypes == ["grad torch.float32", "loss torch.bfloat16"]


def _offload_parity(one_rank_collectives):
    collectives_at_one_rank(one_rank_collectives)  # False: the shortcuts' copy-in alone
    seen = {}

    def shard(model):
        _shard_each_layer(offload_policy=CPUOffloadPolicy(pin_memory=True))(model)
        seen["shards"] = {p.to_local().device.type for p in model.parameters()}
        seen["pinned"] = all(p.to_local().is_pinned() for p in model.parameters())
    report = check_parity(_gpt, shard, _batch, _loss, steps=4, optimizer="adamw", lr=1e-3,
                          rtol=RTOL, atol=ATOL)
    return seen, report.max_weight_diff


@pytest.mark.parametrize("one_rank_collectives", [True, False])
def test_cpu_offload_with_compute_on_the_gpu_matches_the_reference(one_rank_collectives):
    for seen, _ in run_distributed(_offload_parity, WORLD, one_rank_collectives,
                                   backend="nccl"):
        assert seen == {"shards": {"cpu"}, "pinned": True}


def _params_on_device_parity(one_rank_collectives):
    """CPU offload whose units keep a copy of their shards on the GPU (Note [parameters
    kept on the device]): the reference's training, the shards pinned on the host, the
    copies on the GPU."""
    collectives_at_one_rank(one_rank_collectives)  # False: the shortcuts' copy-in alone
    built = []

    def shard(model):
        _shard_each_layer(offload_policy=CPUOffloadPolicy(pin_memory=True,
                                                          params_on_device=True))(model)
        built.append(model)
    report = check_parity(_gpt, shard, _batch, _loss, steps=4, optimizer="adamw", lr=1e-3,
                          rtol=RTOL, atol=ATOL)
    model = built[0]
    copies = [unit._unit.group.storage.device_copy for unit in (model, *model.layers)]
    return ({p.to_local().device.type for p in model.parameters()},
            all(p.to_local().is_pinned() for p in model.parameters()),
            {c.device.type if c is not None else None for c in copies}), report.max_weight_diff


@pytest.mark.parametrize("one_rank_collectives", [True, False])
def test_parameters_kept_on_the_gpu_beside_cpu_offload_match_the_reference(one_rank_collectives):
    for seen, _ in run_distributed(_params_on_device_parity, WORLD, one_rank_collectives,
                                   backend="nccl"):
        assert seen == ({"cpu"}, True, {"cuda"}), seen
