"""``plan``: the fastest training configuration whose estimated peak fits a budget.

Note [how plans are ranked]
Each candidate gets an explicit relative step-time cost, and the cheapest that
fits wins:

    strategy   no_shard 1.00 < shard_grad_op 1.05 < full_shard 1.10
               (full_shard gathers every unit again in backward; shard_grad_op
               keeps it gathered; no_shard gathers nothing and all-reduces)
    + activation checkpointing   x 1.33  (forward runs twice for the blocks)
    + offload (only if allowed)  x 2.00  (host-device copies and a CPU optimizer)
    + offload of k of L blocks   x (1 + 1.00 k/L)  (the offload factor's excess scaled
                                 by the fraction: k = 1 .. L-1, every distinct
                                 fraction of the model's L blocks; full_shard only)
    + states on disk             offload's factor x 1.30 more (only with a states
                                 directory, and then only when a host budget rules
                                 CPU offload out); of k of L blocks, that factor's
                                 excess scaled by k/L, as above: x (1 + 1.60 k/L)
    + parameters on disk too     x 1.30 more again (likewise, when states on disk
                                 are not enough for the host budget; of k of L
                                 blocks x (1 + 2.38 k/L))
    micro-batch                  x 1.15 per halving below the requested size
                                 (smaller kernels; gradient accumulation keeps
                                 the global batch: only halvings that divide it)

    expert parallelism x 1.00  (a model with grouped experts, full_shard or
                               shard_grad_op: each degree N dividing both the experts
                               and the world size, the smallest first at equal cost)

A partial offload (``--parallel.offload cpu:FRACTION``, Note [which blocks a fraction
offloads]) moves the last k blocks' shards, gradients and states to the host and pays
for their copies and host steps only, so its cost lies between no offload and full
offload, and a fitting one ranks ahead of full offload. ``disk:PATH:FRACTION`` does the
same with those blocks' states (and, with parameters on disk, their shards) in files:
it frees the device as the CPU offload of the same k does and holds less on the host,
so it wins where the host budget refuses the CPU offload of every k that fits the device.
Of each family of partial offloads (one strategy, checkpointing, micro-batch,
expert-parallel degree and place: host, disk, disk with parameters) the plan takes the
smallest k that fits (Note [finding the smallest k]).

Expert parallelism is not charged: it trades a block's expert all-gathers and
reduce-scatters over every rank for the same over world / N ranks of 1/N of the experts,
plus two all-to-alls of the routed tokens each way. The projection (docs/projection.md)
finds that faster inside a node and slower across nodes (1.24x at 512 GPUs, N 2), and
plan knows no nodes: it is a memory lever first, chosen before recomputation at equal
strategy and micro-batch.

A micro-batch below the batch accumulates: the trainer reduces after the last
micro-batch only, and keeps every unsharded gradient until then (in an fp32
accumulator; under no_shard in fp32, the gradients themselves, already counted), so
such a candidate's estimate gains an "accumulated gradients" line of 4 bytes per
trainable parameter.

"Fits" means the estimate times ``1 + margin`` is within the budget: the
estimate's measured error is a few percent (docs/memory.md), the margin covers it.
With a host budget, offloaded candidates must also fit it with their host memory
(shards, gradients and, unless on disk, optimizer states) times ``1 + margin``.
zero1 is not a candidate: it moves what shard_grad_op moves and holds more (Note
[ZeRO-1 is ZeRO-2 keeping the gathered storage]), so it never wins on either count.
Quantized weights (NF4, float8) do not run on no_shard's 2-D mesh, and int8
communication has no all-gather or reduce-scatter to quantize there, so with either
no_shard is considered at world size 1 only. A step is traced once per
(checkpointing, micro-batch, experts split or not) and replayed for each strategy,
offload choice and expert-parallel degree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ..gpt import GroupedExperts, MoE
from ..core.state import DEFAULT_BUCKET_NUMEL
from .estimate import MemoryEstimate, block_units, check_delayed_update
from .candidate import Candidate
from .plan_search import Judge, blocks_stay_apart

STRATEGY_COST = {"no_shard": 1.00, "shard_grad_op": 1.05, "full_shard": 1.10}
CHECKPOINTING_COST = 1.33
OFFLOAD_COST = 2.00
DISK_COST = 1.30  # over OFFLOAD_COST: the step waits on the disk (docs/benchmarks.md)
HALVING_COST = 1.15


@dataclass(frozen=True)
class Plan:
    """The chosen candidate, its estimate, and the ones ruled out before it."""

    choice: Candidate | None
    estimate: MemoryEstimate | None
    budget_bytes: int
    rejected: list[tuple[Candidate, int]]  # (candidate, estimated bytes), cheapest first
    host_budget_bytes: int | None = None
    offload_dir: str | None = None         # where --parallel.offload disk: puts the states

    def explain(self) -> str:
        mib = 2 ** 20
        lines = []
        for cand, nbytes in self.rejected[:4]:
            where = "host memory" if nbytes < 0 else "estimated"
            lines.append(f"  {_describe(cand)}: {abs(nbytes) / mib:,.0f} MiB {where}, "
                         "over budget")
        if len(self.rejected) > 4:
            lines.append(f"  ... {len(self.rejected) - 4} more over budget")
        if self.choice is None:
            return "\n".join([f"nothing fits in {self.budget_bytes / mib:,.0f} MiB:"] + lines)
        head = (f"chosen: {_describe(self.choice)}: {self.estimate.total / mib:,.0f} MiB "
                f"estimated (peak in {self.estimate.peak_phase}) of "
                f"{self.budget_bytes / mib:,.0f} MiB; relative step cost "
                f"{self.choice.cost:.2f} (ranking: docs/memory.md)")
        return "\n".join([head] + (["faster options ruled out:"] + lines if lines else []))

    def train_flags(self, precision: str | None = None) -> str:
        """The ``fullshard train`` flags that run the chosen configuration."""
        c = self.choice
        flags = [f"--parallel.strategy {c.strategy}",
                 f"--parallel.activation_checkpointing {str(c.activation_checkpointing).lower()}",
                 f"--batch.batch_size {c.micro_batch}", f"--batch.grad_accum {c.grad_accum}"]
        if c.states_on_disk:
            fraction = f":{c.offload_blocks / c.blocks!r}" if c.offload_blocks else ""
            flags.append(f"--parallel.offload disk:{self.offload_dir}{fraction}")
            if c.params_on_disk:
                flags.append("--parallel.offload_params true")
        elif c.offload:
            flags.append(f"--parallel.offload {c.offload_mode}")
        if c.ep > 1:
            flags.append(f"--parallel.ep {c.ep}")
        if precision:
            flags.append(f"--parallel.precision {precision}")
        s = self.estimate.settings
        if s.get("optimizer") == "muon":  # the trainer's default is adamw
            flags.append("--optim.name muon")
        if s.get("quantize_comm", "none") != "none":
            flags.append(f"--parallel.quantize {s['quantize_comm']}")
        if s.get("lora_rank"):
            flags.append(f"--lora.rank {s['lora_rank']}")
            flags.append(f"--lora.base {'nf4' if s.get('quantize') == 'nf4' else 'fp32'}")
        return " ".join(flags)


def _describe(c: Candidate) -> str:
    parts = [c.strategy] + ([f"experts split over {c.ep} ranks"] if c.ep > 1 else []) \
        + (["activation checkpointing"] if c.activation_checkpointing else []) \
        + ([_offload_words(c)] if c.offload else [])
    return f"{' + '.join(parts)}, micro-batch {c.micro_batch} x {c.grad_accum} accumulation"


def _offload_words(c: Candidate) -> str:
    """``c``'s offload as the plan names it: of how many blocks, and what is on disk."""
    blocks = f" of the last {c.offload_blocks} of {c.blocks} blocks" if c.offload_blocks else ""
    return f"offload{blocks}{_ON_DISK[(c.states_on_disk, c.params_on_disk)]}"


_ON_DISK = {(False, False): "", (True, False): " (states on disk)",
            (True, True): " (states and parameters on disk)"}


def expert_degrees(model: nn.Module, world_size: int) -> tuple[int, ...]:
    """The expert-parallel degrees ``model`` can run at: 1, and with grouped experts every
    N dividing both their count and ``world_size``."""
    counts = {m.n_experts for m in model.modules()
              if isinstance(m, MoE) and isinstance(m.experts, GroupedExperts)}
    common = math.gcd(world_size, *counts) if counts else 1
    return tuple(n for n in range(1, common + 1) if common % n == 0)


def candidates(batch_size: int, allow_offload: bool,
               strategies: tuple[str, ...] = tuple(STRATEGY_COST),
               allow_disk: bool = False, ep_degrees: tuple[int, ...] = (1,),
               blocks: int = 0) -> list[Candidate]:
    """Every configuration considered, cheapest first (Note [how plans are ranked]);
    with ``allow_offload``, the offload of the last k of ``blocks`` for k = 1 .. L-1."""
    micro_batches, mb, halvings = [], batch_size, 0
    while mb >= 1:
        if batch_size % mb == 0:  # accumulation reaches exactly the batch asked for
            micro_batches.append((halvings, mb))
        mb, halvings = mb // 2, halvings + 1
    out = []
    for strategy in strategies:
        base = STRATEGY_COST[strategy]
        for ac in (False, True):
            # (offload, the last k blocks only or 0: all, disk: 1 states, 2 and parameters)
            disks = (0, 1, 2) if allow_disk else (0,)
            offloads = [(False, 0, 0)] + ([(True, k, disk) for disk in disks
                                           for k in [*range(1, blocks), 0]]
                                          if allow_offload else [])
            for offload, k, disk in offloads:
                if offload and strategy != "full_shard":
                    continue
                for halvings, mb in micro_batches:
                    cost = base * (CHECKPOINTING_COST if ac else 1) \
                        * _offload_cost(offload, k, blocks, disk) \
                        * HALVING_COST ** halvings
                    for ep in ep_degrees:
                        if ep > 1 and strategy not in ("full_shard", "shard_grad_op"):
                            continue
                        out.append(Candidate(strategy, ac, offload, mb, batch_size // mb,
                                             round(cost, 4), disk >= 1, disk == 2, ep,
                                             k, blocks if k else 0))
    return sorted(out, key=lambda c: c.rank)


def _offload_cost(offload: bool, k: int, blocks: int, disk: int = 0) -> float:
    """Note [how plans are ranked]: 1 without offload, OFFLOAD_COST with all of it (k
    0), times DISK_COST per level on disk (1: states, 2: and parameters), its excess
    over 1 scaled by k / L for the last k of L blocks."""
    if not offload:
        return 1.0
    whole = OFFLOAD_COST * DISK_COST ** disk
    return 1 + (whole - 1) * k / blocks if k else whole


def plan(model_or_config: Any, *, world_size: int, budget_bytes: int, batch_size: int,
         seq_len: int | None = None, margin: float = 0.10, allow_offload: bool = False,
         host_budget_bytes: int | None = None, offload_dir: str | None = None,
         **estimate_kwargs: Any) -> Plan:
    """The cheapest candidate whose estimate x (1 + margin) fits ``budget_bytes`` (and,
    offloaded, whose host memory x (1 + margin) fits ``host_budget_bytes`` if given).
    With ``allow_offload``, offloading the last k of the model's L blocks is a candidate
    for each k < L, the smallest k that fits taken (Note [finding the smallest k]); with
    ``offload_dir`` too, offload with the optimizer states in that directory.

    ``batch_size`` is the per-rank batch wanted per optimizer step; smaller micro-batches
    reach it by gradient accumulation. Other keywords go to ``estimate``."""
    if offload_dir is not None:  # the disk candidates cannot run the delayed update
        check_delayed_update("disk", estimate_kwargs.get("delayed_update", False))
    trace_keys = ("mp_policy", "loss_of", "quantize", "lora_rank")
    trace_kwargs = {k: v for k, v in estimate_kwargs.items() if k in trace_keys}
    replay_kwargs = {k: v for k, v in estimate_kwargs.items() if k not in trace_keys}
    quantized_comm = replay_kwargs.get("quantize_comm", "none") != "none"
    strategies = tuple(s for s in STRATEGY_COST if not (
        s == "no_shard" and world_size > 1 and (trace_kwargs.get("quantize") or quantized_comm)))
    judge = Judge(model_or_config, world_size, seq_len, trace_kwargs, replay_kwargs,
                   budget_bytes, host_budget_bytes, margin)
    # the cheapest candidate is always the whole micro-batch without recomputation or
    # split experts: its trace, needed anyway, also says which degrees the model can run
    # and how many blocks a fraction counts
    whole = judge.trace(False, batch_size, False)
    listed = candidates(batch_size, allow_offload, strategies, offload_dir is not None,
                        expert_degrees(whole.model, world_size), len(block_units(whole.units)))
    scan = not blocks_stay_apart(whole, replay_kwargs.get("bucket_numel",
                                                           DEFAULT_BUCKET_NUMEL))
    best: tuple[Candidate, MemoryEstimate] | None = None
    searched: set[tuple] = set()
    for cand in listed:
        if best is not None and cand.rank >= best[0].rank:
            break  # nothing from here on is cheaper than the partial offload found
        if cand.offload_blocks:
            if cand.family not in searched:
                searched.add(cand.family)
                family = [c for c in listed if c.offload_blocks and c.family == cand.family
                          and (best is None or c.rank < best[0].rank)]
                best = judge.smallest_fitting(family, scan) or best
            continue
        est = judge.fits(cand)
        if est is not None:
            best = (cand, est)
            break
    judge.rejected.sort(key=lambda entry: entry[0].rank)
    return Plan(best and best[0], best and best[1], budget_bytes, judge.rejected,
                host_budget_bytes, offload_dir)
