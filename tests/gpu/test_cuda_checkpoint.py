"""CUDA lane: checkpoints of models whose shards live on the GPU (NCCL ranks).

A blocking save (DCP copies each shard to the host as it writes and hashes it), a
background save (shards staged in host memory first), a load into a fresh sharded model
on the GPU, and a load into a plain model on one GPU in this process.
"""

import lanes

lanes.require_cuda_lane()

import os  # noqa: E402 - only once the lane is known to run

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from fullshard import checkpoint as ckpt  # noqa: E402
from fullshard import fully_shard  # noqa: E402
from fullshard.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from fullshard.testing import (collectives_at_one_rank, rank_device,  # noqa: E402
                               run_distributed, visible_gpus)
from fullshard.testing.models import token_batch  # noqa: E402

WORLD = visible_gpus()
CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=2, n_heads=4)


def _sharded(seed):
    torch.manual_seed(seed)
    model = GPT(CFG).to(rank_device())
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, step):
    x, y = (t.to(rank_device()) for t in token_batch(step, 4, CFG.vocab_size, CFG.seq_len))
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _on_host(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in model.state_dict().items()}


def _save_train_on_load(root):
    collectives_at_one_rank()  # one GPU: the gathers and reductions run, not shortcuts
    model, opt = _sharded(0)
    for step in range(3):
        _step(model, opt, step)
    at_save = _on_host(model)
    ckpt.save(os.path.join(root, "step_3"), model, opt, extra={"step": 3})
    pending = ckpt.save(os.path.join(root, "step_3_async"), model, opt, extra={"step": 3},
                        async_save=True)
    straight = [_step(model, opt, step) for step in range(3, 5)]  # while the save runs
    pending.result()
    results = {"at_save": at_save}
    for name in ("step_3", "step_3_async"):
        fresh, fresh_opt = _sharded(1)  # other weights: the load must replace them all
        assert ckpt.load(os.path.join(root, name), fresh, fresh_opt) == {"step": 3}
        loaded = _on_host(fresh)
        assert all(p.to_local().device == rank_device() for p in fresh.parameters())
        assert all(torch.equal(loaded[k], at_save[k]) for k in at_save), name
        resumed = [_step(fresh, fresh_opt, step) for step in range(3, 5)]
        results[name] = (straight, resumed)
    return results


def test_save_and_load_of_gpu_shards(tmp_path):
    results = run_distributed(_save_train_on_load, WORLD, str(tmp_path), backend="nccl")
    for name in ("step_3", "step_3_async"):
        straight, resumed = results[0][name]
        # the same kernels on the same data; embedding backward's atomic adds may reorder
        # its sums, hence close rather than equal
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=name: f"resumed from {n}: {m}")
    plain = GPT(CFG).cuda()  # this process: no process group, one GPU
    ckpt.load(str(tmp_path / "step_3"), plain)
    at_save = results[0]["at_save"]
    for k, v in plain.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), at_save[k]), k
