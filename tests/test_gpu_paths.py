"""What the CUDA paths decide, checked on CPU: the trainer's process-group backend
under offload, clipping offloaded gradients, micro-batches through pinned memory, and
the background save's thread on the caller's GPU. Running them on a GPU is the CUDA
lane's (tests/gpu) and `make gpu-check`'s."""

import pytest
import threading

import torch

from fullshard import CPUOffloadPolicy, clip_grad_norm_, fully_shard
from fullshard.checkpoint import background
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from fullshard.train.launch import process_group_backend
from fullshard.train.loop import on_device

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def test_offloading_runs_add_gloo_beside_nccl_for_host_tensors():
    assert process_group_backend("cuda", offload=True) == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cuda", offload=False) == "nccl"
    assert process_group_backend("cpu", offload=True) == "gloo"


def _clip_offloaded():
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = GPT(CFG)
    reference.load_state_dict(model.state_dict())
    for layer in model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    x, y = token_batch(0, 4, CFG.vocab_size, CFG.seq_len)
    rank = torch.distributed.get_rank()
    lm_loss(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
    lm_loss(reference(x), y).backward()
    norm = clip_grad_norm_(model.parameters(), 0.01)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.to_local().device.type == "cpu"
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7)
    return float(norm)


@pytest.mark.slow
def test_clipping_offloaded_gradients_matches_one_process():
    """What the trainer calls (fullshard.clip_grad_norm_: the norm is reduced on the mesh's
    device whatever device the gradients live on)."""
    norms = run_distributed(_clip_offloaded, 2)
    assert norms[0] == norms[1] > 0.01


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


def test_the_background_save_thread_works_on_the_callers_gpu(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: seen.append(("set_device", device,
                                                    threading.current_thread().name)))

    def job():
        seen.append(("job", threading.current_thread().name))
        return "done"
    assert background.submit(job).result() == "done"
    background.wait_for_pending_save()
    (what, device, thread), (then, job_thread) = seen
    assert (what, device, then) == ("set_device", 3, "job")
    assert thread == job_thread != threading.current_thread().name
