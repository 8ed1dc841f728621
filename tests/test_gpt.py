"""fullshard.gpt: the mixture of experts' two layouts compute the same function."""

import pytest
import torch

from fullshard.gpt import GPT, GPTConfig, gpt_loss

CFG = dict(vocab_size=48, seq_len=8, d_model=32, n_layers=2, n_heads=2, n_experts=8, top_k=2)


def _as_grouped(listed: dict) -> dict:
    """A ModuleList model's state dict in the grouped layout: experts stacked in order."""
    out = {}
    for key, value in listed.items():
        pre, sep, rest = key.partition(".experts.")
        if not sep:
            out[key] = value
        elif rest.startswith("0."):
            n = CFG["n_experts"]
            out[f"{pre}.experts.{rest[2:]}"] = torch.stack(
                [listed[f"{pre}.experts.{e}.{rest[2:]}"] for e in range(n)])
    return out


def test_grouped_experts_compute_what_a_module_list_of_experts_does():
    """The same weights stacked give the same loss and gradients; an expert no token
    chose gets a zero gradient in the stack (it has none as its own module)."""
    torch.manual_seed(0)
    listed = GPT(GPTConfig(**CFG))
    grouped = GPT(GPTConfig(**CFG, grouped_experts=True))
    grouped.load_state_dict(_as_grouped(listed.state_dict()))
    idx = torch.randint(0, CFG["vocab_size"], (1, 3), generator=torch.Generator().manual_seed(1))
    losses = [gpt_loss(model, idx, idx) for model in (listed, grouped)]
    for loss in losses:
        loss.backward()
    assert losses[0].item() == losses[1].item()
    grads = {k: (v.grad if v.grad is not None else torch.zeros_like(v))
             for k, v in listed.named_parameters()}
    for key, value in _as_grouped(grads).items():
        grad = grouped.get_parameter(key).grad
        assert grad is not None, key
        torch.testing.assert_close(grad, value, rtol=1e-6, atol=1e-7, msg=key)
    # 3 tokens x top 2 of 8 experts: some expert of each block got none
    assert any(p.grad is None for n, p in listed.named_parameters() if ".experts." in n)


def test_the_meta_trace_shares_rows_evenly_over_grouped_experts():
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG, grouped_experts=True))
        out = model(torch.zeros(2, 8, dtype=torch.long))
    assert out.shape == (2, 8, CFG["vocab_size"]) and out.is_meta


def _exchange_rows_on_two_ranks() -> tuple[bool, int]:
    """Expert parallelism over 2 ranks, 2 experts each: every row reaches the rank of its
    expert, which scales it by (expert + 1), and comes back in order; returns whether it
    did and how many host reads (tolist) the exchange made."""
    import torch.distributed as dist

    from fullshard.gpt import exchange_rows

    rank, local = dist.get_rank(), 2
    expert = torch.tensor([[0, 0, 1, 3, 3, 3], [0, 1, 2, 2, 2, 2]][rank])  # sorted by expert
    routed = torch.randn(len(expert), 5, generator=torch.Generator().manual_seed(rank))
    counts = torch.bincount(expert, minlength=2 * local)

    def experts(rows, per_expert):
        first = rank * local  # this rank's experts: rows arrive sorted by them
        return torch.cat([part * (first + e + 1)
                          for e, part in enumerate(rows.split(per_expert))])

    reads, real = [0], torch.Tensor.tolist

    def counted(self):
        reads[0] += 1
        return real(self)

    torch.Tensor.tolist = counted
    try:
        out = exchange_rows(experts, routed, counts, dist.group.WORLD)
    finally:
        torch.Tensor.tolist = real
    return torch.equal(out, routed * (expert + 1)[:, None].to(routed.dtype)), reads[0]


@pytest.mark.slow
def test_rows_travel_to_their_experts_and_back_with_one_host_read():
    from fullshard.testing import run_distributed

    assert run_distributed(_exchange_rows_on_two_ranks, 2) == [(True, 1), (True, 1)]
