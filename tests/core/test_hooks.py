"""The hooks (core/hooks.py): a forward without backward frees what it gathered, uses the
weights of the last optimizer step, and under inference mode prepares nothing that
training cannot write later; a backward that creates a graph (a gradient penalty) leaves
the parameters gathered for the backward through it."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from fullshard.gpt import GPT, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_collectives
from support.small_gpt import CFG, rank_batch, sharded_gpt


def _no_grad_worker():
    model = sharded_gpt(raf=False)
    x, _ = rank_batch()
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
    x, y = rank_batch()
    model(x)  # grad enabled, never backpropagated: the root stays gathered
    with torch.no_grad():
        for p, rp in zip(sharded, ref.parameters()):
            p.add_(1.0)
            rp.add_(1.0)
    torch.testing.assert_close(model(x), ref(x))
    return True


def test_forward_after_update_uses_new_weights():
    assert run_distributed(_stale_worker, 2) == [True, True]


class _SGDThroughData(torch.optim.Optimizer):
    """Plain SGD written as older optimizers are, through ``.data``: autograd does not
    count those writes in the parameter's version."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        stepped = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in stepped:
            p.data.add_(p.grad.data, alpha=-self.defaults["lr"])


def _gathered_across_step_worker(how):
    """Parameters left gathered when the optimizer steps (kept across backward, or gathered
    ahead by unshard()): the next forward computes with the stepped values, as one process
    does, and gathers again to get them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = sharded_gpt()
    torch.manual_seed(0)
    reference = GPT(CFG)
    units = [model, *model.layers]
    build = _SGDThroughData if how == "through .data" else torch.optim.SGD
    opt, ref_opt = build(model.parameters(), lr=0.5), build(reference.parameters(), lr=0.5)
    gathers = []
    for step in range(3):
        if how != "unshard()":
            model.set_reshard_after_backward(False)
        with count_collectives() as counts:
            x, y = rank_batch(step)
            lm_loss(model(x), y).backward()
        gathers.append(counts.get("all_gather", 0) + counts.get("all_gather_async", 0))
        for r in range(world):
            xr, yr = rank_batch(step - rank + r)
            (lm_loss(reference(xr), yr) / world).backward()
        if how == "unshard()":
            for unit in units:
                unit.unshard()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for unit in units:
        unit.reshard()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
    return gathers


@pytest.mark.parametrize("how", ["kept across backward", "unshard()", "through .data"])
def test_parameters_gathered_across_an_optimizer_step_are_gathered_again(how):
    """Note [gathered parameters after an optimizer step]: torch's FSDP2 computes the next
    forward with the values from before the step, silently."""
    gathers = run_distributed(_gathered_across_step_worker, 2, how)[0]
    assert gathers[1] == gathers[2] == gathers[0] > 0, gathers


def _written_through_the_parameter_while_kept():
    """Parameters kept gathered across backward, then written in place through the DTensor
    parameter (an op on it, an init function, a copy into it): the next forward computes with
    the written values, as without the flag. A DTensor's in-place op writes its local tensor
    below autograd, so only the parameter's own version counter sees it."""
    writes = {
        "mul_": lambda m: m.layers[0].mlp.fc.weight.mul_(0.5),
        "nn.init": lambda m: torch.nn.init.zeros_(m.layers[1].attn.qkv.bias),
        "copy_": lambda m: m.lm_head.weight.copy_(m.lm_head.weight * 2),
    }
    seen = {}
    for name, write in writes.items():
        outputs = []
        for keep in (False, True):
            model = sharded_gpt()
            model.set_reshard_after_backward(not keep, recurse=True)
            x, y = rank_batch()
            lm_loss(model(x), y).backward()
            with torch.no_grad():
                write(model)
                outputs.append(model(x))
        seen[name] = torch.equal(*outputs)
    return seen


def test_a_write_through_the_parameter_reaches_parameters_kept_gathered():
    for seen in run_distributed(_written_through_the_parameter_while_kept, 2):
        assert all(seen.values()), seen


def _kept_backward_worker():
    """Parameters kept gathered across backward: until the next forward the module shows
    the sharded ones with their gradients, so a clip over model.parameters() clips as
    without the flag (torch's FSDP2 shows the gathered ones, whose gradients are gone, and
    clips nothing); the next forward gathers nothing."""
    norms, shown, gathers = [], [], []
    for keep in (False, True):
        model = sharded_gpt()
        model.set_reshard_after_backward(not keep)
        x, y = rank_batch()
        lm_loss(model(x), y).backward()
        shown.append(all(isinstance(p, DTensor) and p.grad is not None
                         for p in model.parameters()))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).full_tensor())
        with count_collectives() as counts:
            model(x)
        gathers.append(counts.get("all_gather", 0) + counts.get("all_gather_async", 0))
    return norms[0].item(), norms[1].item(), shown, gathers


def test_parameters_kept_across_backward_show_the_shards_and_their_gradients():
    plain, kept, shown, gathers = run_distributed(_kept_backward_worker, 2)[0]
    assert kept == plain > 0 and shown == [True, True], (plain, kept, shown)
    assert gathers[1] == 0 < gathers[0], gathers


def _inference_then_train_worker(bucket_numel, raf):
    """The first forward runs under torch.inference_mode (it lazily initialises, merges
    small units and allocates every buffer), then the model trains, with more
    inference-mode forwards between steps: the same outputs and weights as one process."""
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = sharded_gpt(raf, bucket_numel)  # seeded as the reference: the same weights
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


def _penalized_loss(model, x, scale):
    """A gradient penalty (WGAN-GP's): the input gradient computed with create_graph=True,
    then backpropagated through with the loss."""
    x = x.clone().requires_grad_()
    out = model(x)
    input_grad, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return (out.square().mean() + (input_grad.norm(dim=1) - 1).square().mean()) * scale


def _gradient_penalty_worker():
    return all(_gradient_penalty_run(bucket_numel) for bucket_numel in (0, 1 << 20))


def _gradient_penalty_run(bucket_numel):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 3))
    model = copy.deepcopy(reference)
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    model.set_bucket_numel(bucket_numel)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for step in range(3):
        xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + r))
              for r in range(world)]
        _penalized_loss(model, xs[rank], 1.0).backward()
        for x in xs:
            _penalized_loss(reference, x, 1 / world).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
    return all(isinstance(p, DTensor) for p in model.parameters())  # resharded after


def test_a_gradient_penalty_through_create_graph_trains_as_one_process():
    """Note [a backward that creates a graph]: the backward that builds the penalty's graph
    leaves the parameters gathered for the backward through it (torch's FSDP2 frees them
    and fails there: "setStorage: ... storage of size 0"); units per layer, then merged."""
    assert run_distributed(_gradient_penalty_worker, 2) == [True, True]
