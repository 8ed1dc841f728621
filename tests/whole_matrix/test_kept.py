"""What a whole-matrix optimizer's owners keep between steps (Note [whole-matrix
optimizers], "Between steps"): the bytes each step moves, ``state_dict()`` in torch's
layout, loads, resets, parameters changed between steps, and resuming at another world
size, each against one process stepped by the stock optimizer on the same gradients."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fullshard.testing import run_distributed
from fullshard.testing.parity import full_value
from support.catalogue import matches_documented
from support.whole_matrix_runs import max_diff, mlp_blocks, shard_blocks, train_steps

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon")


def _muon(model) -> list[torch.optim.Optimizer]:
    """Muon on the matrices; the biases under plain SGD, which keeps no state, so that a
    checkpoint of Muon's alone resumes the whole run."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
            torch.optim.SGD(others, lr=1e-2)]


class _Pair:
    """A sharded model and one process's copy stepped on the sharded run's gradients."""

    def __init__(self):
        self.model, self.reference = shard_blocks(mlp_blocks()), mlp_blocks()
        self.opts, self.ref_opts = _muon(self.model), _muon(self.reference)
        self.step_no = 0

    def step(self, sent: list | None = None) -> float:
        """One step of both; ``sent`` gets the bytes the optimizer steps send."""
        rank, world = dist.get_rank(), dist.get_world_size()
        train_steps(self.model, [], 1, rank, world, first=self.step_no)
        self.step_no += 1
        for p, q in zip(self.model.parameters(), self.reference.parameters()):
            q.grad = full_value(p.grad) if p.grad is not None else None
        counted = _sent_bytes(lambda: [opt.step() for opt in self.opts + self.ref_opts])
        if sent is not None:
            sent.append(counted)
        for opt in self.opts + self.ref_opts:
            opt.zero_grad()
        return max_diff(self.model, self.reference)

    def matrices(self) -> list:
        return [p for p in self.model.parameters() if p.ndim == 2]


def _sent_bytes(fn) -> int:
    """Bytes this step's all-to-alls send off each rank, summed over the ranks."""
    real, sent = dist.all_to_all_single, [0]

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                **kwargs):
        me = dist.get_rank(group)
        sent[0] += (input.numel() - input_split_sizes[me]) * input.element_size()
        return real(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    dist.all_to_all_single = counted
    try:
        fn()
    finally:
        dist.all_to_all_single = real
    total = torch.tensor(sent[0])
    dist.all_reduce(total)
    return total.item()


def _bytes_and_state() -> dict:
    from fullshard.whole_matrix import exchange, kept
    pair = _Pair()
    out = {"diffs": [], "bytes": []}

    def step():
        out["diffs"].append(pair.step(out["bytes"]))

    step()                             # the first: gradient and parameter there, rows back
    step()                             # steady: the gradient there, the rows back
    # each matrix's bytes that lie off its owner (items: the optimizer's order)
    out["off_owner"] = [(item.param.numel() - exchange.numel(item, item.owner))
                        * item.param.element_size() for item in kept._KEPT[pair.opts[0]].items]
    state = pair.opts[0].state_dict()  # the owners hand the momentum back
    out["layout"] = all(
        isinstance(s["momentum_buffer"], DTensor) and s["momentum_buffer"].placements
        == p.placements and s["momentum_buffer"].shape == p.shape
        for p, s in zip(pair.matrices(), state["state"].values()))
    refs = [q for q in pair.reference.parameters() if q.ndim == 2]
    out["momentum"] = max((full_value(s["momentum_buffer"])
                           - pair.ref_opts[0].state[q]["momentum_buffer"]).abs().max().item()
                          for q, s in zip(refs, state["state"].values()))
    step()                             # the momentum travels back to the owners, once
    with torch.no_grad():              # parameters changed between steps: by every rank,
        pair.matrices()[0].mul_(0.5)   # and by one rank alone, through .data
        if dist.get_rank() == 1:
            pair.matrices()[3].to_local().data.add_(1.0)
    for p, q in zip(pair.model.parameters(), pair.reference.parameters()):
        q.data.copy_(full_value(p.detach()))
    step()                             # those two are gathered again
    for opts in (pair.opts, pair.ref_opts):  # a reset: a fresh optimizer's state loaded
        opts[0].load_state_dict(_muon(pair.reference)[0].state_dict())
    step()
    pair.opts[0].state.clear()         # and removed by hand
    pair.ref_opts[0].state.clear()
    step()
    return out


@pytest.mark.slow
@pytest.mark.extended
def test_owners_keep_states_and_parameters_and_a_step_moves_the_least():
    out = run_distributed(_bytes_and_state, 3)[0]
    assert out["diffs"] == [0.0] * 6, out["diffs"]
    assert out["layout"] and out["momentum"] == 0.0, out
    off = sum(out["off_owner"])
    # per step: gradient to the owner, update back (2x what lies off the owners); the
    # first step adds every parameter, the step after a change the two changed ones, the
    # step after state_dict() the momentum; a load or a clear of the states moves nothing
    changed = out["off_owner"][0] + out["off_owner"][3]
    assert out["bytes"] == [3 * off, 2 * off, 3 * off, 2 * off + changed, 2 * off, 2 * off], out


def _save(directory: str) -> float:
    """Two steps at this world size, then a checkpoint of the model and Muon (its
    momentum handed back by the owners) and, from rank 0, one process's copy."""
    from fullshard import checkpoint
    pair = _Pair()
    diff = max(pair.step() for _ in range(2))
    checkpoint.save(os.path.join(directory, "sharded"), pair.model, pair.opts[0])
    if dist.get_rank() == 0:
        torch.save({"model": pair.reference.state_dict(),
                    "muon": pair.ref_opts[0].state_dict()}, os.path.join(directory, "one.pt"))
    dist.barrier()
    return diff


def _resume(directory: str) -> list[float]:
    """The checkpoint loaded at this world size, and two more steps."""
    from fullshard import checkpoint
    pair = _Pair()
    pair.step_no = 2
    checkpoint.load(os.path.join(directory, "sharded"), pair.model, pair.opts[0])
    one = torch.load(os.path.join(directory, "one.pt"))
    pair.reference.load_state_dict(one["model"])
    pair.ref_opts[0].load_state_dict(one["muon"])
    return [max_diff(pair.model, pair.reference)] + [pair.step() for _ in range(2)]


@pytest.mark.slow
@pytest.mark.extended
def test_owner_kept_states_resume_at_another_world_size(tmp_path):
    assert run_distributed(_save, 2, str(tmp_path)) == [0.0, 0.0]
    for diffs in run_distributed(_resume, 3, str(tmp_path)):
        assert diffs == [0.0, 0.0, 0.0], diffs


def _loaded_on_one_rank() -> str:
    pair = _Pair()
    pair.step()
    if dist.get_rank() == 0:  # a fresh optimizer's state: rank 0's entries are gone
        pair.opts[0].load_state_dict(_muon(pair.reference)[0].state_dict())
    try:
        pair.step()
        return "no error"
    except RuntimeError as err:
        return str(err)


@pytest.mark.slow
def test_states_loaded_on_some_ranks_only_are_refused_on_every_rank():
    for text in run_distributed(_loaded_on_one_rank, 2):
        assert "on some ranks of its shard group than on others" in text, text
        assert matches_documented("E225", f"RuntimeError: {text}"), text


def _state_dict_on_rank0_only() -> str:
    os.environ["FULLSHARD_ARRIVAL_TIMEOUT"] = "3"
    pair = _Pair()
    pair.step()  # the owners hold the momentum now
    if dist.get_rank() == 0:
        try:
            pair.opts[0].state_dict()
        except Exception as err:  # noqa: BLE001 - the message is the result
            return f"{type(err).__name__}: {err}"
        return "no error"
    return "not called"


@pytest.mark.slow
def test_state_dict_on_some_ranks_only_is_refused_not_a_hang():
    text, peer = run_distributed(_state_dict_on_rank0_only, 2, timeout=120)
    assert peer == "not called"
    assert text.startswith("CollectiveError: fullshard: Muon.state_dict()"), text
    assert "call it on every rank" in text, text
