"""``estimate``: per-rank peak memory of fullshard training, line by line.

The model is built on the meta device (nothing is allocated), its units and
buckets are laid out as ``fully_shard`` and the root's lazy init would
(units.py), one step is traced for activations (activations.py), and
fullshard's buffer schedule is replayed over it (replay.py). See docs/memory.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..activation_checkpointing import apply_activation_checkpointing
from ..core.comm import DEFAULT_MAX_NUMEL
from ..core.comm_groups import check_reduces_in_flight
from ..core.features.quantized_collectives import DEFAULT_BLOCK_SIZE
from ..core.state import DEFAULT_BUCKET_NUMEL
from ..gpt import GroupedExperts
from ..offload.fraction import offloaded_blocks, parse_fraction
from ..policies import DiskOffloadPolicy, MixedPrecisionPolicy
from ..whole_matrix.recipe import muon_matrices
from ..wrap import repeated_block_classes
from .activations import StepTrace, trace_step
from .models import LossOf, workload_for
from .process import current_rss_bytes
from .byte_ledger import CATEGORIES
from .replay import Replay
from .run_settings import RunSettings
from .units import find_units, layout_groups
from .weights import WeightBytes, adapt_weights, check_weights

STRATEGIES = ("full_shard", "shard_grad_op", "zero1", "no_shard")
# State tensors torch's optimizers keep per parameter (SGD: with momentum; muon: AdamW's,
# on what the recipe leaves to AdamW; its Muon matrices: replay.owned_whole_numel).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "muon": 2, "sgd": 0, "sgd-momentum": 1, "adagrad": 1,
                    "rmsprop": 1}
BASELINE = "process baseline"
DISK_CHUNK_NUMEL = DiskOffloadPolicy.__dataclass_fields__["chunk_numel"].default


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes at the peak, and what was alive then."""

    lines: dict[str, int]             # CATEGORIES + process baseline, at the peak
    peak_phase: str                   # forward | backward | optimizer
    phase_peaks: dict[str, int]       # each phase's peak, baseline included
    host_bytes: int                   # offloaded shards, gradients, states at their peak
    num_params: int
    trainable_params: int
    settings: dict[str, Any] = field(default_factory=dict)
    disk_bytes: int = 0               # optimizer states in files (offload="disk")

    @property
    def total(self) -> int:
        return sum(self.lines.values())

    def table(self) -> str:
        """The breakdown as an aligned text table (MiB)."""
        s = self.settings
        head = (f"{s['model']}: {self.num_params / 1e6:,.1f}M parameters, world size "
                f"{s['world_size']}, {s['strategy']}"
                + (f" (experts split over {s['ep']} ranks)" if s.get("ep", 1) > 1 else "")
                + f", {s['dtype']}, batch {s['batch_size']} x "
                f"{s['seq_len']}, {s['optimizer']}"
                + (", activation checkpointing" if s["activation_checkpointing"] else "")
                + ({"cpu": ", offload", "disk": ", offload (states on disk)",
                    "disk+params": ", offload (states and parameters on disk)"}.get(
                    s["offload"], f", offload {s['offload']}" if s["offload"] != "none"
                    else ""))
                + (", delayed update" if s.get("delayed_update") else "")
                + (", parameters kept on the device" if s.get("params_on_device") else "")
                + (f", {s['quantize']} weights" if s.get("quantize") else "")
                + (f", LoRA rank {s['lora_rank']} ({self.trainable_params / 1e6:,.1f}M "
                   "trainable)" if s.get("lora_rank") else "") + f", {s['device']}")
        rows = [(name, nbytes) for name, nbytes in self.lines.items()]
        rows.append((f"peak per rank (in {self.peak_phase})", self.total))
        width = max(len(n) for n, _ in rows)
        out = [head, ""] + [f"  {n:<{width}}  {b / 2**20:>12,.1f} MiB" for n, b in rows]
        out.append("  " + "  ".join(f"{p} peak {b / 2**20:,.0f} MiB"
                                    for p, b in self.phase_peaks.items()))
        if self.host_bytes:
            out.append(f"  host memory for offloaded states  {self.host_bytes / 2**20:,.1f} MiB")
        if self.disk_bytes:
            out.append(f"  disk for optimizer states         {self.disk_bytes / 2**20:,.1f} MiB")
        return "\n".join(out)


def estimate(model_or_config: Any, *, world_size: int, strategy: str = "full_shard",
             reshard_after_forward: bool | int | None = None,
             mp_policy: MixedPrecisionPolicy | torch.dtype | None = None,
             offload: bool | str = False, activation_checkpointing: bool = False,
             batch_size: int = 1, seq_len: int | None = None, optimizer: str = "adamw",
             device: str = "cuda", bucket_numel: int = DEFAULT_BUCKET_NUMEL,
             process_baseline: int | None = None, loss_of: LossOf | None = None,
             quantize: str | None = None, lora_rank: int = 0,
             quantize_comm: str = "none", ep: int = 1,
             reduces_in_flight: int = 1, delayed_update: bool = False,
             params_on_device: bool = False) -> MemoryEstimate:
    """Estimate one rank's peak memory for training ``model_or_config`` with fullshard.

    Args:
        model_or_config: a GPTConfig, a preset name, a Hugging Face config (config.json
            path, directory, dict or PretrainedConfig), or an nn.Module on the meta device.
        world_size: ranks training together.
        strategy: ``full_shard`` (ZeRO-3), ``shard_grad_op`` (ZeRO-2: parameters stay
            gathered from forward to backward), ``zero1`` (ZeRO-1: shard_grad_op whose
            gathered parameters stay allocated across steps; Note [ZeRO-1 is ZeRO-2
            keeping the gathered storage] in train/model.py) or ``no_shard`` (replicated,
            as DDP).
        reshard_after_forward: overrides ``strategy`` with fully_shard's argument (an int N
            keeps parameters sharded N ways between forward and backward: hpZ).
        mp_policy: a MixedPrecisionPolicy, or a dtype meaning param_dtype=dtype with fp32
            gradient reduction.
        offload: ``"cpu"`` (or True): shards, gradients and optimizer states on the host
            (CPUOffloadPolicy); ``"cpu:FRACTION"``: the same for the last
            ceil(FRACTION x blocks) blocks only (``--parallel.offload cpu:FRACTION``);
            ``"disk"``: the same with the optimizer states in files, the host holding
            three chunks of them (DiskOffloadPolicy's default chunk_numel);
            ``"disk+params"``: the parameter shards on disk too (paged in one unit at a
            time); ``"disk:FRACTION"``, ``"disk+params:FRACTION"``: either for the last
            blocks only (``--parallel.offload disk:PATH:FRACTION``); ``"none"`` (or
            False): on the device.
        activation_checkpointing: every unit but the root recomputes its forward.
        batch_size, seq_len: the micro-batch per rank (seq_len defaults to the model's).
        optimizer: adamw, adam, muon, sgd, sgd-momentum, adagrad or rmsprop (muon: the
            recipe ``fullshard train --optim.name muon`` builds, Muon on the hidden
            matrices with its one state, the owners' whole copies and each rank's rows as
            last written, and the pieces of the rounds its step runs in, Note [whole-matrix
            optimizers]; AdamW's two states on the embeddings, head, norms and biases).
        device: ``cuda`` (NCCL; figures comparable to torch.cuda.max_memory_allocated)
            or ``cpu`` (gloo; figures comparable to peak RSS).
        bucket_numel: fullshard's small-unit merging threshold (set_bucket_numel).
        process_baseline: bytes the process holds before the model exists; default 0 on
            cuda, this process's RSS on cpu.
        loss_of: fn(model, batch, seq) -> loss, for modules that are not GPT or HF LMs.
        quantize: the linear layers of the blocks as ``nf4`` (torchao NF4, frozen: needs
            ``lora_rank``, QLoRA) or ``float8`` (trained, gathered in float8: torchao's
            Float8Linear with enable_fsdp_float8_all_gather). Note [quantized weights in
            the estimate] in memory/weights.py.
        lora_rank: LoRA adapters of this rank beside every linear layer of the blocks,
            every other weight frozen (``fullshard train --lora.rank``); 0: none.
        quantize_comm: ``weights``, ``grads`` or ``weights,grads``: int8 all-gathers and/or
            reduce-scatters (set_quantized_communication; ``--parallel.quantize``), whose
            send and receive buffers and fp32 (de)quantizing passes are counted.
        ep: expert parallelism (``fullshard train --parallel.ep``; a GPT with
            ``grouped_experts``): each block's experts a unit of their own holding
            ``1/ep`` of them, sharded over ``world_size / ep`` ranks (Note [expert
            parallelism in the trainer]). The trace routes tokens evenly, so a rank's
            experts compute on as many rows as without it; the all-to-alls' buffers (a
            block's routed rows, twice) are not counted.
        reduces_in_flight: gradient reductions left in flight, each holding its send
            buffer (``set_reduce_scatter_max_input_buffers``; Note [reductions in flight]).
        delayed_update: the offloaded units stepped by ``OverlappedStep(delayed=True)``
            (``fullshard train --parallel.delayed_update N``): each keeps a copy of its
            shard and a second gradient buffer on the host (Note [the delayed update]),
            counted in ``host_bytes``. CPU offload only: disk units are not delayed (E365).
        params_on_device: with ``offload`` ``cpu`` or ``disk`` (and their fractions), each
            offloaded unit also keeps a copy of its shard on the device in the compute
            dtype, which its gathers copy in from (``CPUOffloadPolicy(params_on_device=
            True)``, ``fullshard train --parallel.params_on_device true``; Note
            [parameters kept on the device]).
    """
    _check_run(strategy, reshard_after_forward, world_size, optimizer, quantize, lora_rank,
               ep)
    step = trace_workload(model_or_config, mp_policy=mp_policy,
                          activation_checkpointing=activation_checkpointing,
                          batch_size=batch_size, seq_len=seq_len, loss_of=loss_of,
                          quantize=quantize, lora_rank=lora_rank, split_experts=ep > 1)
    return estimate_traced(step, world_size=world_size, strategy=strategy,
                           reshard_after_forward=reshard_after_forward, offload=offload,
                           optimizer=optimizer, device=device, bucket_numel=bucket_numel,
                           process_baseline=process_baseline, quantize_comm=quantize_comm,
                           ep=ep, reduces_in_flight=reduces_in_flight,
                           delayed_update=delayed_update, params_on_device=params_on_device)


@dataclass(frozen=True)
class TracedStep:
    """One micro-batch's step traced on the meta device: what ``estimate`` replays for
    each strategy (the trace does not depend on the strategy, offload or world size)."""

    name: str
    model: nn.Module
    units: list[nn.Module]
    subclass: dict[int, WeightBytes]  # tensor-subclass parameters' bytes, by id
    trace: StepTrace
    policy: MixedPrecisionPolicy
    param_dtype: torch.dtype
    batch_size: int
    seq_len: int
    activation_checkpointing: bool
    quantize: str | None
    lora_rank: int
    split_experts: bool = False  # grouped experts traced as units of their own


def trace_workload(model_or_config: Any, *, mp_policy: MixedPrecisionPolicy | torch.dtype
                   | None = None, activation_checkpointing: bool = False, batch_size: int = 1,
                   seq_len: int | None = None, loss_of: LossOf | None = None,
                   quantize: str | None = None, lora_rank: int = 0,
                   split_experts: bool = False) -> TracedStep:
    """Build the model on the meta device as configured and trace one step of it (with
    ``split_experts``, the grouped experts as units of their own: for ``ep`` > 1)."""
    check_weights(quantize, lora_rank, "full_shard", None, 1)
    workload = workload_for(model_or_config, loss_of)
    seq = workload.seq_len_or(seq_len)
    policy = MixedPrecisionPolicy(param_dtype=mp_policy, reduce_dtype=torch.float32) \
        if isinstance(mp_policy, torch.dtype) else (mp_policy or MixedPrecisionPolicy())
    model = workload.build()
    units = find_units(model, split_experts)
    if split_experts and not any(isinstance(u, GroupedExperts) for u in units):
        raise ValueError(f"estimate: ep splits grouped experts (a GPTConfig with n_experts "
                         f"and grouped_experts=True); {workload.name} has none: leave ep at 1")
    param_dtype = next(model.parameters()).dtype
    subclass = adapt_weights(model, units, quantize, lora_rank)
    model.to(policy.param_dtype or param_dtype)  # the trace computes in the gathered dtype
    if policy.output_dtype is not None:
        model.register_forward_hook(lambda _m, _a, out: out.to(policy.output_dtype)
                                    if isinstance(out, torch.Tensor) else out)
    if activation_checkpointing:
        checkpointed = {id(u) for u in units[:-1]}
        apply_activation_checkpointing(model, lambda m: id(m) in checkpointed)
    trace = trace_step(model, units, lambda m: workload.loss_of(m, batch_size, seq))
    return TracedStep(workload.name, model, units, subclass, trace, policy, param_dtype,
                      batch_size, seq, activation_checkpointing, quantize, lora_rank,
                      split_experts)


def estimate_traced(step: TracedStep, *, world_size: int, strategy: str = "full_shard",
                    reshard_after_forward: bool | int | None = None,
                    offload: bool | str = False,
                    optimizer: str = "adamw", device: str = "cuda",
                    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                    process_baseline: int | None = None,
                    quantize_comm: str = "none", ep: int = 1,
                    reduces_in_flight: int = 1, delayed_update: bool = False,
                    params_on_device: bool = False) -> MemoryEstimate:
    """``estimate`` of a traced step: fullshard's schedule replayed over it."""
    check_reduces_in_flight(reduces_in_flight, "estimate: reduces_in_flight",
                            wrong_type=ValueError)
    _check_run(strategy, reshard_after_forward, world_size, optimizer, step.quantize,
               step.lora_rank, ep)
    if (ep > 1) != step.split_experts:
        raise ValueError(f"estimate: ep={ep} needs a step traced with split_experts="
                         f"{ep > 1}")
    raf = _reshard_rule(strategy, reshard_after_forward, world_size)
    offload = offload_mode(offload)
    check_delayed_update(offload, delayed_update)
    check_params_on_device(offload, params_on_device)
    if quantize_comm not in ("none", "weights", "grads", "weights,grads"):
        raise ValueError("estimate: quantize_comm must be none, weights, grads or "
                         f"weights,grads, got {quantize_comm!r}")
    if quantize_comm != "none" and strategy == "no_shard" and world_size > 1:
        raise ValueError(f"estimate: quantize_comm={quantize_comm!r} quantizes all-gathers and "
                         "reduce-scatters, which no_shard does not issue")
    words = quantize_comm.split(",")
    shard_size = 1 if strategy == "no_shard" and reshard_after_forward is None else world_size
    policy, param_dtype, model = step.policy, step.param_dtype, step.model
    compute_dtype = policy.param_dtype or param_dtype
    reduce_dtype = policy.reduce_dtype_for(param_dtype) or compute_dtype  # Note [torch versions]
    groups = layout_groups(step.units, shard_size, raf, bucket_numel, step.subclass, ep,
                           offloaded_units(step.units, offload))
    settings = RunSettings(
        param_dtype=param_dtype, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
        optimizer_states=OPTIMIZER_STATES[optimizer], foreach_optimizer=device != "cpu",
        whole_matrix=frozenset(id(p) for p in muon_matrices(model))
        if optimizer == "muon" else frozenset(),
        device=torch.device(device), backend="gloo" if device == "cpu" else "nccl",
        pool_max_numel=DEFAULT_MAX_NUMEL, offload=offload in ("cpu", "disk", "disk+params"),
        states_on_disk=DISK_CHUNK_NUMEL if offload.startswith("disk") else 0,
        params_on_disk=offload.startswith("disk+params"),
        quantize_weights=DEFAULT_BLOCK_SIZE if "weights" in words else 0,
        quantize_grads=DEFAULT_BLOCK_SIZE if "grads" in words else 0,
        replicated=shard_size == 1 and world_size > 1, heap_retention=device == "cpu",
        keep_unsharded=strategy == "zero1" and reshard_after_forward is None,
        reduces_in_flight=reduces_in_flight, delayed_update=bool(delayed_update),
        pinned_host=device == "cuda", params_on_device=params_on_device)
    replay = Replay(groups, step.trace, settings, [type(u).__name__ for u in step.units])
    peaks = replay.run()
    if process_baseline is None:
        process_baseline = current_rss_bytes() if device == "cpu" else 0
    phase, peak = max(peaks.items(), key=lambda kv: kv[1].total)
    lines = {c: peak.breakdown[c] for c in CATEGORIES}
    lines[BASELINE] = process_baseline
    return MemoryEstimate(
        lines=lines, peak_phase=phase,
        phase_peaks={p: v.total + process_baseline for p, v in peaks.items()},
        host_bytes=replay.ledger.host_peak, disk_bytes=replay.disk_bytes, num_params=sum(p.numel() for p in model.parameters()),
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
        settings={"model": step.name, "world_size": world_size,
                  "strategy": _strategy_name(strategy, reshard_after_forward),
                  "dtype": _dtype_name(policy, param_dtype), "batch_size": step.batch_size,
                  "seq_len": step.seq_len, "optimizer": optimizer, "offload": offload,
                  "activation_checkpointing": step.activation_checkpointing,
                  "device": device, "quantize": step.quantize, "lora_rank": step.lora_rank,
                  "quantize_comm": quantize_comm, "ep": ep,
                  "delayed_update": bool(delayed_update) and offload != "none",
                  "params_on_device": params_on_device})


def check_delayed_update(offload: str, delayed_update: bool) -> None:
    """Refuse the delayed update beside disk offload (an ``offload_mode``), as
    ``OverlappedStep(delayed=True)`` does (Note [the delayed update])."""
    if delayed_update and offload.startswith("disk"):
        raise ValueError(f"estimate: delayed_update=True delays the host step of CPU-offloaded "
                         f"units, and offload={offload!r} keeps the optimizer states in files, "
                         "whose units are not delayed (E345); use offload 'cpu' or "
                         "'cpu:FRACTION', or drop delayed_update.")


def check_params_on_device(offload: str, params_on_device: bool) -> None:
    """Refuse ``params_on_device`` where nothing offloaded keeps its parameters on the host
    (an ``offload_mode``), as ``fully_shard`` refuses it beside parameters on disk (E386)."""
    if not isinstance(params_on_device, bool):
        raise ValueError(f"estimate: params_on_device must be True or False, got "
                         f"{params_on_device!r}")
    if params_on_device and (offload == "none" or offload.startswith("disk+params")):
        raise ValueError(f"estimate: params_on_device=True keeps a copy on the device of "
                         f"parameters offloaded to the host, and offload={offload!r} "
                         + ("keeps them on the device already" if offload == "none" else
                            "pages them from files") + "; use offload 'cpu' or 'disk' (or "
                         "their fractions), or drop params_on_device.")


def offloaded_units(units: list[nn.Module], offload: str) -> frozenset[int]:
    """Indices of the units a partial offload (``cpu:FRACTION``, ``disk:FRACTION``,
    ``disk+params:FRACTION``: the trainer's unit_offload) offloads: the last blocks and the
    units inside them (Note [which blocks a fraction offloads])."""
    kind, colon, fraction = offload.partition(":")
    if not colon:
        return frozenset()
    blocks = [units[i] for i in block_units(units)]
    inside = {id(m) for b in offloaded_blocks(blocks, float(fraction)) for m in b.modules()}
    return frozenset(i for i, u in enumerate(units[:-1]) if id(u) in inside)


def block_units(units: list[nn.Module]) -> list[int]:
    """Indices, in model order, of the units that are the root's repeated blocks: the L
    blocks a ``cpu:FRACTION`` counts (the root is ``units[-1]``)."""
    classes = repeated_block_classes(units[-1])
    return [i for i, u in enumerate(units[:-1]) if type(u) in classes]


def offload_mode(offload: bool | str) -> str:
    """``none``, ``cpu``, ``disk`` or ``disk+params``, each of the last three with
    ``:FRACTION`` (0 < FRACTION < 1) for the last blocks only, for estimate's ``offload``
    argument."""
    if offload in (False, None, "none"):
        return "none"
    if offload is True:
        return "cpu"
    if isinstance(offload, str):
        kind, colon, text = offload.partition(":")
        if kind in ("cpu", "disk", "disk+params"):
            if not colon:
                return kind
            # ValueError: not in (0, 1]
            fraction = parse_fraction(text, offload, f"{kind}:FRACTION", f"{kind}:0.5")
            return kind if fraction == 1 else f"{kind}:{fraction!r}"
    raise ValueError("estimate: offload must be none, cpu, disk or disk+params, the last "
                     "three with :FRACTION for the last blocks only (or a bool), "
                     f"got {offload!r}")


def _check_run(strategy: str, reshard_after_forward: bool | int | None, world_size: int,
               optimizer: str, quantize: str | None, lora_rank: int, ep: int = 1) -> None:
    """Bad input, before the (slow) trace."""
    _reshard_rule(strategy, reshard_after_forward, world_size)
    if ep < 1 or world_size % ep:
        raise ValueError(f"estimate: ep={ep} must divide world_size {world_size}")
    if ep > 1 and (strategy not in ("full_shard", "shard_grad_op")
                   or reshard_after_forward not in (None, True, False)):
        raise ValueError(f"estimate: ep={ep} is estimated with strategy full_shard or "
                         f"shard_grad_op, not {_strategy_name(strategy, reshard_after_forward)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"estimate: optimizer {optimizer!r} not in {sorted(OPTIMIZER_STATES)}")
    check_weights(quantize, lora_rank, strategy, reshard_after_forward, world_size)


def _reshard_rule(strategy: str, reshard_after_forward: bool | int | None,
                  world_size: int) -> bool | int:
    """fully_shard's ``reshard_after_forward`` for the blocks (what an int N means is
    core's: ``after_forward_rule``)."""
    if reshard_after_forward is not None:
        if isinstance(reshard_after_forward, bool):
            return reshard_after_forward
        n = reshard_after_forward
        if n < 1 or world_size % n:
            raise ValueError(f"estimate: reshard_after_forward={n} must divide world_size "
                             f"{world_size}")
        return n
    if strategy not in STRATEGIES:
        raise ValueError(f"estimate: strategy {strategy!r} not in {STRATEGIES}")
    return strategy == "full_shard"


def _strategy_name(strategy: str, reshard_after_forward: bool | int | None) -> str:
    if reshard_after_forward is None:
        return strategy
    return f"reshard_after_forward={reshard_after_forward}"


def _dtype_name(policy: MixedPrecisionPolicy, param_dtype: torch.dtype) -> str:
    if policy.param_dtype is None:
        return str(param_dtype).removeprefix("torch.")
    reduce = policy.reduce_dtype_for(param_dtype) or policy.param_dtype
    return (f"{str(policy.param_dtype).removeprefix('torch.')} compute, "
            f"{str(reduce).removeprefix('torch.')} reduce")
