"""Partial CPU offload in the planner (memory/plan.py, Note [how plans are ranked], Note
[finding the smallest k]): the last k of L blocks offloaded, costed between no offload
and full offload, the smallest k that fits taken."""

import sys

import pytest

from fullshard.gpt import GPTConfig
from fullshard.memory import estimate, plan
from fullshard.memory.estimate import estimate_traced, trace_workload
from fullshard.memory.plan import OFFLOAD_COST, STRATEGY_COST, candidates
from fullshard.memory.plan_search import bisect_first, blocks_stay_apart

# blocks of 1.2M elements: above the 2**20 merging threshold, each a group of its own;
# activations are small beside the model states, so checkpointing saves little
BLOCKS = GPTConfig(vocab_size=256, seq_len=32, d_model=320, n_layers=8, n_heads=4)
# blocks of 12K elements, merged into buckets
TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=8, n_heads=2)
KW = dict(world_size=2, batch_size=1, seq_len=32, process_baseline=0)


def _offload(k: int, blocks: int) -> str:
    return "none" if k == 0 else "cpu" if k == blocks else f"cpu:{k / blocks!r}"


def _device(cfg, k, **kw):
    return estimate(cfg, offload=_offload(k, cfg.n_layers), **{**KW, **kw})


def test_partial_offloads_are_every_fraction_of_the_blocks_costed_between():
    listed = candidates(2, True, blocks=8)
    partial = [c for c in listed if c.offload_blocks]
    assert {(c.offload_blocks, c.blocks) for c in partial} == {(k, 8) for k in range(1, 8)}
    assert {c.strategy for c in partial} == {"full_shard"}
    for c in partial:
        full = next(f for f in listed if f.offload and not f.offload_blocks
                    and f.family == c.family and not f.states_on_disk)
        none = next(n for n in listed if not n.offload and n.family == c.family)
        assert none.cost < c.cost < full.cost
        assert c.cost == pytest.approx(none.cost * (1 + (OFFLOAD_COST - 1) * c.offload_blocks / 8),
                                       abs=1e-4)
        assert c.offload_mode == f"cpu:{c.offload_blocks / 8!r}"
    k1 = next(c for c in partial if c.offload_blocks == 1 and c.micro_batch == 2
              and not c.activation_checkpointing)
    assert k1.cost == round(STRATEGY_COST["full_shard"] * (1 + 1 / 8), 4)
    # no offload allowed, or a model of one block (no k strictly between 0 and L)
    assert not [c for c in candidates(2, False, blocks=8) if c.offload]
    assert not [c for c in candidates(2, True, blocks=1) if c.offload_blocks]
    assert listed == sorted(listed, key=lambda c: c.rank)


@pytest.mark.parametrize("world_size, ac, dtype", [
    (1, False, None), (2, False, None), (2, True, None), (8, True, None),
    (2, False, "bf16")])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_device_bytes_fall_with_k_whereblocks_stay_apart(world_size, ac, dtype, device):
    """Note [finding the smallest k]: what bisection over k relies on."""
    import torch

    step = trace_workload(BLOCKS, batch_size=2, activation_checkpointing=ac,
                          mp_policy=torch.bfloat16 if dtype else None)
    assert blocks_stay_apart(step, 2 ** 20)
    runs = [estimate_traced(step, world_size=world_size, offload=_offload(k, 8),
                            device=device, process_baseline=0) for k in range(9)]
    device_bytes = [r.total for r in runs]
    assert device_bytes == sorted(device_bytes, reverse=True), device_bytes
    assert device_bytes[0] > device_bytes[7] > device_bytes[8]
    host = [r.host_bytes for r in runs]
    assert host == sorted(host) and host[0] == 0


def test_merged_blocks_break_the_claim_and_are_scanned():
    """Small blocks merge into buckets, and the device bytes rise again from k = 3 (8
    blocks, world 8, checkpointing): the plan scans k there and still finds k = 3, which
    bisection from k = 7 would have missed."""
    kw = dict(world_size=8, batch_size=1, seq_len=16, process_baseline=0)
    step = trace_workload(TINY, activation_checkpointing=True)
    assert not blocks_stay_apart(step, 2 ** 20) and blocks_stay_apart(step, 0)
    device_bytes = [estimate_traced(step, world_size=8, offload=_offload(k, 8),
                                    process_baseline=0).total for k in range(9)]
    assert min(device_bytes[1:8]) == device_bytes[3] < device_bytes[7]
    chosen = plan(TINY, budget_bytes=int(device_bytes[3] * 1.1) + 1, allow_offload=True, **kw)
    assert chosen.choice.activation_checkpointing, chosen.explain()
    assert (chosen.choice.offload_blocks, chosen.choice.blocks) == (3, 8), chosen.explain()


@pytest.mark.parametrize("k", [1, 3, 5, 7])
def test_plan_takes_the_smallest_k_that_fits(k):
    """A budget between the estimates of k - 1 and k blocks offloaded (from
    ``estimate``, as the printed fraction asks): plan offloads k, and its estimate is
    ``estimate``'s for that fraction."""
    below, at = _device(BLOCKS, k - 1).total, _device(BLOCKS, k).total
    budget = int((below + at) / 2 * 1.1)
    chosen = plan(BLOCKS, budget_bytes=budget, allow_offload=True, **KW)
    c = chosen.choice
    assert c is not None and (c.offload_blocks, c.blocks) == (k, 8), chosen.explain()
    assert not c.activation_checkpointing and c.strategy == "full_shard"
    assert chosen.estimate.total == at and at * 1.1 <= budget < below * 1.1
    assert chosen.estimate.settings["offload"] == c.offload_mode
    assert f"offload of the last {k} of 8 blocks" in chosen.explain()


def test_plan_prefers_no_offload_then_partial_then_full():
    none, last, full = (_device(BLOCKS, k).total for k in (0, 7, 8))
    fits_all = plan(BLOCKS, budget_bytes=int(none * 1.1) + 1, allow_offload=True, **KW)
    assert not fits_all.choice.offload, fits_all.explain()
    partial = plan(BLOCKS, budget_bytes=int(last * 1.1) + 1, allow_offload=True, **KW)
    assert partial.choice.offload_blocks == 7, partial.explain()  # full offload fits too
    only_full = plan(BLOCKS, budget_bytes=int((last + full) / 2 * 1.1), allow_offload=True,
                     **KW)
    c = only_full.choice
    assert c.offload and not c.offload_blocks and not c.activation_checkpointing, \
        only_full.explain()
    assert only_full.train_flags().endswith("--parallel.offload cpu")
    assert any(r.offload_blocks == 7 for r, _ in only_full.rejected)


def test_a_host_budget_that_rules_the_fraction_out_moves_to_the_next_candidate():
    """Between checkpointing's k = 3 and no checkpointing's k = 3 the device fits k = 4
    without recomputation, or k = 3 with it; a host budget below k = 4's host bytes
    takes the second (k = 3 holds less on the host)."""
    ac3, plain3 = _device(BLOCKS, 3, activation_checkpointing=True), _device(BLOCKS, 3)
    budget = int((ac3.total + plain3.total) / 2 * 1.1)
    free = plan(BLOCKS, budget_bytes=budget, allow_offload=True, **KW)
    assert (free.choice.offload_blocks, free.choice.activation_checkpointing) == (4, False)
    host = int((ac3.host_bytes + free.estimate.host_bytes) / 2 * 1.1)
    held = plan(BLOCKS, budget_bytes=budget, allow_offload=True, host_budget_bytes=host, **KW)
    assert (held.choice.offload_blocks, held.choice.activation_checkpointing) == (3, True), \
        held.explain()
    assert held.estimate.host_bytes * 1.1 <= host
    assert (free.choice, -free.estimate.host_bytes) in held.rejected
    assert all(c.rank < held.choice.rank for c, _ in held.rejected)


@pytest.mark.slow
def test_plan_bisects_k_on_a_deep_model(monkeypatch):
    """64 blocks: the partial offloads of a family take about log2(63) replays, not 63."""
    deep = GPTConfig(vocab_size=256, seq_len=32, d_model=320, n_layers=64, n_heads=4)
    below, at = (_device(deep, k).total for k in (40, 41))
    plan_module = sys.modules["fullshard.memory.plan_search"]
    replays = []
    replay = plan_module.estimate_traced
    monkeypatch.setattr(plan_module, "estimate_traced",
                        lambda step, **kw: replays.append(kw["offload"]) or replay(step, **kw))
    chosen = plan(deep, budget_bytes=int((below + at) / 2 * 1.1), allow_offload=True, **KW)
    assert chosen.choice.offload_blocks == 41, chosen.explain()
    fractions = [o for o in replays if o.startswith("cpu:")]
    # the family without checkpointing: k = 63, then 6 halvings of 1 .. 63; with it, only
    # the k cheaper than the choice (k < 15): one replay at 14, over budget
    assert len(fractions) <= 8, fractions
    assert f"cpu:{41 / 64!r}" in fractions and f"cpu:{40 / 64!r}" in fractions


def test_bisect_first_finds_the_threshold_and_never_answers_wrong():
    for count in range(0, 12):
        for threshold in range(0, count + 1):
            asked = []
            first = bisect_first(count, lambda i: asked.append(i) or i >= threshold)
            assert first == (threshold if threshold < count else None)
            assert len(asked) <= max(1, count).bit_length() + 1
    # whatever the predicate, an answer holds and the index below it does not
    pattern = [False, True, False, False, True, True, False, True]
    first = bisect_first(len(pattern), pattern.__getitem__)
    assert pattern[first] and not pattern[first - 1]


def _trainer_count(blocks: int, text: str) -> int:
    """How many of ``blocks`` blocks the trainer offloads for ``--parallel.offload
    text``: the flag's own parser, the config's check, then the count unit_offload
    takes (parse_fraction, offloaded_blocks)."""
    from fullshard.offload.fraction import offloaded_blocks, parse_fraction
    from fullshard.train.config.schema import _check_offload_fraction, _offload_from_text

    offload = _offload_from_text([text])
    _check_offload_fraction(offload)
    return len(offloaded_blocks(range(blocks), parse_fraction(offload[len("cpu:"):])))


def _printed(k: int, blocks: int) -> str:
    """What plan's command carries for the last k of ``blocks`` (all: cpu:1.0)."""
    from fullshard.memory.plan import Candidate

    if k == blocks:
        return f"cpu:{1.0!r}"
    return Candidate("full_shard", False, True, 1, 1, 1.0, offload_blocks=k,
                     blocks=blocks).offload_mode


def _ceil_alone_is_off() -> list[tuple[int, int]]:
    import math

    return [(k, n) for n in range(1, 97) for k in range(1, n + 1)
            if math.ceil(float(_printed(k, n)[len("cpu:"):]) * n) != k]


def test_the_printed_fraction_gives_the_trainer_k_blocks_for_every_k_up_to_96():
    """plan prints ``cpu:repr(k / L)``; for every k <= L <= 96 the trainer reads it back
    as exactly k of L blocks. A bare ceil(F x L) would not: repr(7 / 25) x 25 is
    7.000000000000001, one of 108 such pairs, for which offloaded_blocks allows (one of
    them goes through the whole command line here, all of them in the next test)."""
    wrong = [(k, n) for n in range(1, 97) for k in range(1, n + 1)
             if _trainer_count(n, _printed(k, n)) != k]
    assert not wrong, wrong[:10]
    off = _ceil_alone_is_off()
    assert len(off) == 108 and (7, 25) in off
    _through_the_command_line(7, 25)


@pytest.mark.extended  # 11 s
def test_the_printed_fraction_survives_the_trainers_command_line():
    """The whole flag path for each pair k <= L <= 96 where ceil(F x L) alone is off."""
    for k, blocks in _ceil_alone_is_off():
        _through_the_command_line(k, blocks)


def _through_the_command_line(k: int, blocks: int) -> None:
    """``fullshard train``'s parser, resolve_config, then unit_offload on the model."""
    import torch

    from fullshard.cli.train import build_parser, resolve_config
    from fullshard.gpt import GPT
    from fullshard.train.model import unit_offload

    argv = ["--preset", "debug", "--gpt.n_layers", str(blocks),
            "--parallel.offload", _printed(k, blocks)]
    cfg, _ = resolve_config(build_parser().parse_args(argv))
    with torch.device("meta"):
        model = GPT(cfg.gpt)
    policy_of = unit_offload(model, cfg.parallel)
    assert sum(policy_of(b) is not None for b in model.layers) == k, (k, blocks)


def _train_flags_offload(flags: list[str], k: int, blocks: int, disk: bool) -> None:
    """``fullshard train``'s parser and resolve_config on plan's printed flags, then
    unit_offload: the last k of ``blocks`` blocks, with states on disk or not."""
    import torch

    from fullshard.cli.train import build_parser, resolve_config
    from fullshard.gpt import GPT
    from fullshard.policies import DiskOffloadPolicy
    from fullshard.train.model import unit_offload

    argv = ["--preset", "debug", "--gpt.n_layers", str(blocks), *flags]
    cfg, _ = resolve_config(build_parser().parse_args(argv))
    with torch.device("meta"):
        model = GPT(cfg.gpt)
    policies = [unit_offload(model, cfg.parallel)(b) for b in model.layers]
    assert all(p is None for p in policies[:blocks - k]), policies
    assert all(isinstance(p, DiskOffloadPolicy) == disk for p in policies[blocks - k:])


# blocks of 12.6M elements: their AdamW states outweigh the disk's three staging chunks
LARGE = GPTConfig(vocab_size=256, seq_len=16, d_model=1024, n_layers=8, n_heads=4)


def test_a_host_budget_that_refuses_the_cpu_fraction_takes_the_same_fraction_on_disk(tmp_path):
    """The device fits 4 of 8 blocks offloaded (and not 3); the host has room for their
    shards and gradients but not their AdamW states: with a states directory the plan
    puts the states of those same 4 blocks in files and prints the flag that does it."""
    kw = {**KW, "seq_len": 16}
    three, four = (estimate(LARGE, offload=f"cpu:{k / 8!r}", **kw) for k in (3, 4))
    on_disk = estimate(LARGE, offload="disk:0.5", **kw)
    assert on_disk.total == four.total and on_disk.host_bytes < four.host_bytes
    budget = int((three.total + four.total) / 2 * 1.1)
    host = int((on_disk.host_bytes + four.host_bytes) / 2 * 1.1)
    free = plan(LARGE, budget_bytes=budget, allow_offload=True, **kw)
    assert (free.choice.offload_blocks, free.choice.states_on_disk) == (4, False)
    held = plan(LARGE, budget_bytes=budget, allow_offload=True, host_budget_bytes=host,
                offload_dir=str(tmp_path), **kw)
    c = held.choice
    assert c is not None and (c.offload_blocks, c.blocks, c.states_on_disk,
                              c.params_on_disk) == (4, 8, True, False), held.explain()
    assert not c.activation_checkpointing
    assert held.estimate.disk_bytes == on_disk.disk_bytes and c.offload_mode == "disk:0.5"
    flags = held.train_flags()
    assert f"--parallel.offload disk:{tmp_path}:0.5" in flags
    _train_flags_offload(flags.split(), k=4, blocks=8, disk=True)
    assert "offload of the last 4 of 8 blocks (states on disk)" in held.explain()
    assert any(r.offload_blocks == 4 and not r.states_on_disk and n < 0
               for r, n in held.rejected)  # CPU offload's, refused by the host
    # the cost sits between the CPU offload of those blocks and putting all on disk
    whole = next(x for x in candidates(1, True, allow_disk=True, blocks=8)
                 if x.states_on_disk and not x.params_on_disk and not x.offload_blocks
                 and x.family[:4] == c.family[:4])
    assert free.choice.cost < c.cost < whole.cost
