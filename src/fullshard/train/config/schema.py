"""The trainer's configuration: typed dataclasses, one docstring per field; the named
presets; reading and writing it as TOML and ``--section.field`` strings.

A run is described by one :class:`TrainConfig`: a preset (:data:`PRESETS`), then a TOML
file (``--config``), then command-line overrides (``--optim.lr 1e-3``) are applied in
that order. The docstring under each field is what ``fullshard train --help`` prints.
Fields that take one of a few values have a ``Literal`` type; numeric fields declare
their bounds in metadata (``bounds.within``): :func:`validate` checks both and the
cross-field rules, raising :class:`ConfigError` with a one-line message that names the
field. Flags and TOML values are parsed by tyro (train/config/flags.py says why tyro).

Named training configurations (and the model each one builds: ``model.build_model``).
``PRESETS[name]`` is a complete :class:`TrainConfig`; ``--config`` files and command-line
flags are applied on top of a copy (:func:`get_preset`). The model shape of a preset is a
plain :class:`GPTConfig` (``fullshard.gpt.PRESET_SHAPES``), so a preset can be sized
without training it::

    from .schema import PRESETS
    from ..model import build_model
    model = build_model(PRESETS["gpt2-124m"].gpt, device="meta")   # no memory allocated

- ``debug``: a tiny GPT that trains for a few seconds (tests, smoke runs).
- ``shakespeare`` (the default): a character-level GPT on Tiny Shakespeare, sized to
  finish in about 5 minutes on 2 CPU cores: 3.2M parameters (d_model 256, 4 layers,
  context 128), 400 steps of 2 ranks x 16 x 128 tokens. A step costs each rank ~0.6 s
  of CPU; the 10.8M-parameter shape of nanoGPT's character model (d_model 384, 6
  layers, context 256) costs ~2 s for the same tokens, so 5 minutes would buy it
  fewer than 150 steps.
- ``gpt2-124m``: GPT-2 small (124,439,808 parameters) with llm.c's 10B-token schedule,
  for GPUs: bf16, 8 ranks x 8 micro-batches x 8 x 1024 tokens = 524,288 tokens a step.
- ``llama-1b``: Llama-3.2-1B's dimensions (d_model 2048, 16 layers, 32 heads, MLP hidden
  8192, vocab 128,256, tied embeddings) on the GPT block: LayerNorm, a GELU MLP and full
  multi-head attention with learned positions, 1.07B parameters where Llama's RMSNorm,
  SwiGLU and grouped-query attention make 1.24B. It has Llama's memory and compute
  profile to within about 15%; fine-tune a real Llama with ``--model hf:PATH``.

The GPU presets read Tiny Shakespeare unless ``--data`` names other text; their
tokenizer is the character one (see ``data.py``), so point them at real data.

A run's TOML (OUT/config.toml, and ``--config`` files) mirrors the dataclasses: top-level
fields first, then one table per section; a value None is written "auto"::

    steps = 600
    [optim]
    lr = 0.002
    [parallel]
    reshard_after_forward = "auto"
"""

from __future__ import annotations

import copy
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import tomli_w
import tyro

from ...gpt import PRESET_SHAPES, GPTConfig
from ...bounds import Bounds, within
from ...errors import ConfigError
from ...offload.fraction import disk_path_and_fraction, parse_fraction

Strategy = Literal["full_shard", "shard_grad_op", "zero1", "hybrid_shard", "no_shard"]
Quantize = Literal["none", "weights", "grads", "weights,grads"]
Precision = Literal["fp32", "bf16", "fp16"]
OptimizerName = Literal["adamw", "muon"]
STRATEGIES = typing.get_args(Strategy)
PRECISIONS = typing.get_args(Precision)
WANDB_FORBIDDEN = "/\\#?%:"  # characters W&B refuses in a project name
BIG = 10 ** 12  # steps and intervals: no run gets near it
# GPTConfig (fullshard.gpt, plain data) carries no metadata: its fields' bounds are here.
GPT_BOUNDS = {"vocab_size": Bounds(1, 2 ** 24), "seq_len": Bounds(1, 2 ** 24),
              "d_model": Bounds(1, 2 ** 20), "n_layers": Bounds(1, 2 ** 14),
              "n_heads": Bounds(1, 2 ** 14), "mlp_ratio": Bounds(1, 1024),
              "n_experts": Bounds(0, 2 ** 14), "top_k": Bounds(1, 2 ** 14),
              "aux_loss_coef": Bounds(0, 1e6)}

_TRUE, _FALSE, _AUTO = ("true", "yes", "on"), ("false", "no", "off"), ("auto", "none")


def _reshard_from_text(args: list[str]) -> bool | int | None:
    word = args[0].strip().lower()
    if word in _AUTO:
        return None
    if word in _TRUE + _FALSE:
        return word in _TRUE
    return int(args[0])  # a ValueError becomes tyro's parse error for the field


# true, false, an int, or auto (None: the strategy's); TOML writes auto as "auto".
ReshardAfterForward = Annotated[bool | int | None, tyro.constructors.PrimitiveConstructorSpec(
    nargs=1, metavar="true|false|N|auto", instance_from_str=_reshard_from_text,
    is_instance=lambda v: v is None or isinstance(v, (bool, int)),
    str_from_instance=lambda v: ["auto" if v is None else str(v).lower()])]


def _offload_from_text(args: list[str]) -> str:
    word = args[0].strip()
    if word.lower() in _FALSE + ("none",):
        return "none"
    if word.lower() in _TRUE + ("cpu",):
        return "cpu"
    if word.lower().startswith("cpu:"):  # the fraction is checked by resolve_config
        return "cpu:" + word[4:]
    if word.lower().startswith("disk:") and word[5:]:
        return "disk:" + word[5:]
    raise ValueError(f"{word!r} is not none, cpu, cpu:FRACTION, disk:PATH or "
                     "disk:PATH:FRACTION")


# none, cpu (true), cpu:FRACTION, disk:PATH or disk:PATH:FRACTION: where shards, gradients
# and optimizer states live.
Offload = Annotated[str, tyro.constructors.PrimitiveConstructorSpec(
    nargs=1, metavar="none|cpu|cpu:FRACTION|disk:PATH", instance_from_str=_offload_from_text,
    is_instance=lambda v: isinstance(v, str), str_from_instance=lambda v: [v])]


def offload_kind(value: str, params: bool = False) -> str:
    """estimate's offload argument (``none``, ``cpu``, ``cpu:FRACTION``, ``disk``,
    ``disk+params``, each of the last two with ``:FRACTION`` when partial) for a
    ``parallel.offload`` value and ``parallel.offload_params``."""
    if value.startswith("disk:"):
        kind = "disk+params" if params else "disk"
        fraction = disk_path_and_fraction(value[5:])[1]
        return kind if fraction == 1 else f"{kind}:{fraction!r}"
    return value


@dataclass
class BatchConfig:
    """What one optimizer step reads."""

    seq_len: int = field(default=256, metadata=within(1, 2 ** 24))
    """Tokens per training sequence (for GPT models at most gpt.seq_len)."""
    batch_size: int = field(default=16, metadata=within(1, 2 ** 20))
    """Sequences per rank in one micro-batch."""
    grad_accum: int = field(default=1, metadata=within(1, 2 ** 20))
    """Micro-batches per optimizer step; gradients are reduced once, after the last."""
    val_fraction: float = field(default=0.1, metadata=within(0, 1, high_open=True))
    """Share of the text, taken from its end, held out for validation."""


@dataclass
class OptimConfig:
    """AdamW (or Muon on the hidden matrices) with linear warmup then cosine decay."""

    name: OptimizerName = "adamw"
    """adamw, or muon: torch.optim.Muon on the hidden matrices (each stepped whole),
    AdamW on embeddings, the output head, norms and biases."""
    lr: float = field(default=1e-3, metadata=within(0, 10))
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = field(default=1e-4, metadata=within(0, 10))
    """Learning rate at the end of the cosine decay, and after it."""
    warmup_steps: int = field(default=100, metadata=within(0, BIG))
    """Steps of linear warmup from 0 to lr."""
    decay_steps: int = field(default=0, metadata=within(0, BIG))
    """Step at which the cosine decay reaches min_lr (0: the run's steps). Fixed when a run
    starts and kept on --resume, so extending a run does not rewrite its past schedule."""
    weight_decay: float = field(default=0.1, metadata=within(0, 100))
    """Decoupled weight decay, applied to matrices only (not to biases, norms)."""
    beta1: float = field(default=0.9, metadata=within(0, 1, high_open=True))
    """AdamW beta1."""
    beta2: float = field(default=0.95, metadata=within(0, 1, high_open=True))
    """AdamW beta2."""
    grad_clip: float = field(default=1.0, metadata=within(0))
    """Clip the global gradient norm to this value (0: no clipping)."""


@dataclass
class ParallelConfig:
    """How the model is sharded and computed."""

    strategy: Strategy = "full_shard"
    """full_shard (ZeRO-3), shard_grad_op (ZeRO-2: parameters stay gathered from forward
    to backward), zero1 (ZeRO-1: parameters gathered all the time, re-gathered after each
    step; gradients and optimizer states sharded), hybrid_shard (shard within a replica group, replicate across groups),
    no_shard (every rank holds everything, gradients all-reduced: DDP)."""
    reshard_after_forward: ReshardAfterForward = None
    """Override the strategy's reshard_after_forward: true, false, or an int N dividing
    the shard group size (keep parameters sharded N ways for backward); auto: the
    strategy's."""
    replicas: int = field(default=0, metadata=within(0, 2 ** 20))
    """hybrid_shard: number of replica groups (0: one per node)."""
    precision: Precision = "fp32"
    """Compute dtype. bf16 and fp16 gather and compute in that dtype and reduce gradients
    in fp32; parameters and optimizer states stay fp32. fp16 scales the loss."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of storing them."""
    compile: bool = False
    """Compile each transformer block with torch.compile before sharding (one graph per
    block; fullshard's gathers and reductions run between them)."""
    ep: int = field(default=1, metadata=within(1, 2 ** 14))
    """Expert parallelism: split each mixture-of-experts block's experts over this many
    ranks (tokens travel to their expert's rank by all-to-all), each part sharded over the
    world size / ep ranks holding the same experts (the GPT with gpt.grouped_experts;
    full_shard or shard_grad_op). 1: every rank holds a shard of every expert."""
    offload_params: bool = False
    """With --parallel.offload disk:PATH, keep the sharded parameters in files under PATH
    too, paged in when used and given back right after."""
    params_on_device: bool = False
    """With --parallel.offload cpu, cpu:FRACTION or disk:PATH (states on disk), keep a copy
    of each offloaded block's sharded parameters on the device in the precision they are
    gathered in, so that its gathers read it: one host-to-device copy per optimizer step
    instead of one per gather (CPUOffloadPolicy(params_on_device=True), DeepSpeed's
    offload_optimizer without offload_param), for the shard's size in device memory."""
    quantize: Quantize = "none"
    """Communicate in int8 with one fp32 scale per 256 elements (ZeRO++): weights (the
    all-gathers), grads (the reduce-scatters, summed in fp32), or weights,grads. For
    bandwidth-bound links; the shards, optimizer and checkpoints stay exact."""
    symm_mem: bool = False
    """Gather every unit's parameters into NCCL symmetric memory (set_symm_mem_for_comm:
    NCCL's copy-engine or symmetric-kernel all-gathers). Needs CUDA, NCCL and a torch
    built with symmetric memory; refused otherwise."""
    overlap_step: bool = True
    """With --parallel.offload cpu, cpu:FRACTION or disk:PATH, step the offloaded blocks on
    a host thread while the next forward runs, each block's forward waiting for its own
    step (fullshard.OverlappedStep: the same values as stepping them all first; on disk,
    each block's states streamed through the files in forward order). false: the whole
    step ends before the next forward starts."""
    step_in_backward: bool = False
    """With overlap_step and --parallel.offload cpu, cpu:FRACTION or disk:PATH, hand each
    offloaded block to the host thread as soon as the last micro-batch's backward hands out
    its gradients, its step overlapping the rest of backward too (fullshard.OverlappedStep.
    stepping_in_backward: the same values). Needs optim.grad_clip 0, a precision other
    than fp16 and delayed_update -1: a clip or loss-scale coefficient is known only after
    the whole backward."""
    delayed_update: int = field(default=-1, metadata=within(-1, BIG))
    """-1: off. N >= 0: with overlap_step and --parallel.offload cpu or cpu:FRACTION, ZeRO-
    Offload's one-step delayed update after N exact steps: the next forward and backward
    compute with the offloaded blocks' parameters before the step in flight and wait for
    nothing (one-step-stale gradients: a different run, see docs/performance.md). Evaluations,
    samples and checkpoints are exact points: the forward after one computes with the
    parameters it saw, so a resume trains on as the uninterrupted run."""
    offload: Offload = "none"
    """cpu: keep parameters, gradients and optimizer states in CPU memory (CPU offload);
    the optimizer steps there, fused. cpu:FRACTION (0 < FRACTION <= 1): only the last
    ceil(FRACTION x blocks) transformer blocks, the rest and the embeddings, head and root
    on the device (cpu:1 is cpu). disk:PATH: the same, with the optimizer states in
    files under the directory PATH (an NVMe disk), streamed through the host a chunk at a
    time during the step; disk:PATH:FRACTION: only the last ceil(FRACTION x blocks) blocks
    so. For models that do not fit the devices (or the host) otherwise. true/false read
    as cpu/none."""


@dataclass
class EvalConfig:
    """Validation and the text sample printed at the end."""

    every: int = field(default=50, metadata=within(0, BIG))
    """Evaluate every this many steps, at step 0 and at the last step (0: only those)."""
    batches: int = field(default=8, metadata=within(1, 2 ** 20))
    """Validation micro-batches per rank per evaluation (the same ones every time)."""
    sample_tokens: int = field(default=300, metadata=within(0, 2 ** 20))
    """Tokens generated for the sample printed at the end (0: no sample)."""
    sample_prompt: str = "\n"
    """Text the sample starts from."""
    temperature: float = field(default=0.8, metadata=within(0, 100))
    """Sampling temperature (0: always the most likely token)."""


@dataclass
class CheckpointConfig:
    """Checkpoints: written under OUT/checkpoints, OUT/checkpoints/latest names the newest."""

    every: int = field(default=100, metadata=within(0, BIG))
    """Save every this many steps (0: only at the end); one is always saved at the end
    and on Ctrl-C."""
    keep: int = field(default=2, metadata=within(1, 10 ** 6))
    """Number of most recent checkpoints kept; older ones are deleted."""


@dataclass
class MetricsConfig:
    """Where metrics go besides OUT/metrics.jsonl and OUT/loss.png (rank 0 writes them)."""

    tensorboard: bool = False
    """Also write TensorBoard event files to OUT (view with tensorboard --logdir OUT); needs
    pip install 'fullshard[tensorboard]'."""
    wandb: str = ""
    """Also log to this Weights & Biases project (empty: off; WANDB_MODE=offline logs to
    OUT/wandb without an account); needs pip install 'fullshard[wandb]'."""


LoraBase = Literal["nf4", "fp32"]


@dataclass
class LoraConfig:
    """LoRA adapters on a Hugging Face model (--model hf:PATH): only they train."""

    rank: int = field(default=0, metadata=within(0, 2 ** 16))
    """Rank of the adapters peft adds beside every linear layer but the output layer (0:
    off, every weight trains); needs pip install 'fullshard[quant]'."""
    alpha: float = field(default=16.0, metadata=within(0, 2 ** 16))
    """LoRA's alpha: the adapters' output is scaled by alpha / rank."""
    base: LoraBase = "nf4"
    """The frozen base weights under the adapters: nf4 (4-bit NormalFloat, torchao:
    QLoRA, gathered in NF4) or fp32."""


@dataclass
class TrainConfig:
    """One training run."""

    model: str = "gpt"
    """gpt (the GPT whose shape is [gpt]) or hf:PATH (a Hugging Face causal LM folder)."""
    data: str = "tinyshakespeare"
    """tinyshakespeare (shipped with fullshard), or a path to plain text or to JSONL whose
    lines hold a "text" field."""
    steps: int = field(default=1000, metadata=within(1, BIG))
    """Optimizer steps in the run (on --resume: the total, counting the steps done)."""
    seed: int = field(default=0, metadata=within(-2 ** 63, 2 ** 63 - 1))  # torch.manual_seed
    """Seeds the initial weights, the data order and the sample."""
    gpt: GPTConfig = field(default_factory=GPTConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def is_hf(self) -> bool:
        return self.model.startswith("hf:")

    @property
    def hf_path(self) -> str:
        return self.model[len("hf:"):]


SECTIONS = ("gpt", "batch", "optim", "parallel", "eval", "checkpoint", "metrics", "lora")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every field's type, choices and bounds and the rules between fields; return
    cfg. Configs built in Python are checked as strictly as those read from flags."""
    for prefix, obj in sections(cfg):
        hints = typing.get_type_hints(type(obj))
        for f in scalar_fields(obj):
            value = getattr(obj, f.name)
            choices = typing.get_args(hints[f.name])
            if typing.get_origin(hints[f.name]) is Literal and value not in choices:
                raise ConfigError(f"{prefix}{f.name}: accepted values are "
                                  f"{', '.join(choices)}; got {value!r}")
            bounds = GPT_BOUNDS.get(f.name) if prefix == "gpt." else f.metadata.get("bounds")
            if bounds is not None:
                bounds.check(prefix + f.name, value)
    if cfg.model != "gpt" and not cfg.is_hf:
        raise ConfigError(f"model: accepted values are gpt or hf:PATH, got {cfg.model!r}")
    if cfg.lora.rank and not cfg.is_hf:
        raise ConfigError("lora.rank: LoRA adapters are added to Hugging Face models "
                          "(--model hf:PATH); the built-in GPT trains every weight")
    if not cfg.is_hf and cfg.batch.seq_len > cfg.gpt.seq_len:
        raise ConfigError(f"batch.seq_len: {cfg.batch.seq_len} exceeds gpt.seq_len "
                          f"{cfg.gpt.seq_len}, the positions the model has")
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr: {cfg.optim.min_lr} is above optim.lr {cfg.optim.lr}")
    if set(WANDB_FORBIDDEN) & set(cfg.metrics.wandb) or len(cfg.metrics.wandb) > 128:
        raise ConfigError(f"metrics.wandb: a W&B project name of at most 128 characters, "
                          f"without any of {' '.join(WANDB_FORBIDDEN)}; got "
                          f"{cfg.metrics.wandb!r}")
    raf = cfg.parallel.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool) and not 1 <= raf <= 2 ** 20:
        raise ConfigError(f"parallel.reshard_after_forward: accepted values are true, false, "
                          f"auto or an int in [1, {2 ** 20}], got {raf}")
    if cfg.parallel.strategy == "zero1" and raf is not None and raf is not False:
        raise ConfigError(f"parallel.reshard_after_forward: {raf} frees the parameters that "
                          "parallel.strategy zero1 keeps gathered; leave it auto, or choose "
                          "full_shard")
    if cfg.parallel.quantize != "none" and cfg.parallel.strategy == "no_shard":
        raise ConfigError(f"parallel.quantize: {cfg.parallel.quantize} quantizes all-gathers "
                          "and reduce-scatters, which parallel.strategy no_shard does not "
                          "issue; choose a sharded strategy or parallel.quantize none")
    if cfg.lora.rank and cfg.lora.base == "nf4" and (
            cfg.parallel.strategy in ("no_shard", "hybrid_shard")
            or (isinstance(raf, int) and not isinstance(raf, bool))):
        asked = (f"parallel.strategy {cfg.parallel.strategy}"
                 if cfg.parallel.strategy in ("no_shard", "hybrid_shard")
                 else f"parallel.reshard_after_forward {raf}")
        raise ConfigError(f"lora.base: nf4 base weights gather through their tensor subclass, "
                          f"which fullshard does not combine with {asked}; choose full_shard, "
                          "shard_grad_op or zero1, or lora.base fp32")
    _check_expert_parallel(cfg)
    _check_step_in_backward(cfg)
    _check_delayed_update(cfg)
    offload = cfg.parallel.offload
    _check_offload_fraction(offload)
    if offload not in ("none", "cpu") and not offload.startswith("cpu:") \
            and not (offload.startswith("disk:") and offload[5:]):
        raise ConfigError(f"parallel.offload: accepted values are none, cpu, cpu:FRACTION, "
                          f"disk:PATH or disk:PATH:FRACTION; got {offload!r}")
    check_optimizer(cfg.optim.name, grouped_experts=not cfg.is_hf and bool(cfg.gpt.n_experts)
                    and cfg.gpt.grouped_experts, states_on_disk=offload.startswith("disk:"))
    if cfg.parallel.offload_params and not offload.startswith("disk:"):
        raise ConfigError(f"parallel.offload_params: parameters go to disk with "
                          f"parallel.offload disk:PATH, not with parallel.offload {offload}; "
                          "give a directory, or leave offload_params false")
    if cfg.parallel.params_on_device and (offload == "none" or cfg.parallel.offload_params):
        raise ConfigError("parallel.params_on_device: keeps a copy on the device of "
                          "parameters offloaded to the host, and "
                          + ("parallel.offload none offloads nothing"
                             if offload == "none" else "parallel.offload_params true pages "
                             "them from files")
                          + "; use parallel.offload cpu, cpu:FRACTION or disk:PATH with "
                          "offload_params false, or leave params_on_device false")
    if offload.startswith("disk:") and not os.path.isdir(disk_dir := disk_path_and_fraction(
            offload[5:])[0]):
        raise ConfigError(f"parallel.offload: {disk_dir} is not a directory; create it, or "
                          "name a directory on a local disk for the optimizer states")
    return cfg


def check_optimizer(name: str, *, grouped_experts: bool, states_on_disk: bool,
                    flag: str = "optim.name") -> None:
    """Refuse an optimizer the trainer cannot step the model with: Muon (2-D matrices,
    each stepped whole) on grouped experts' 3-D tensors, or on optimizer states on disk
    (stepped a chunk of elements at a time). ``flag`` names the optimizer's flag in the
    message: train's, or estimate's and plan's, which must refuse what train refuses."""
    if name != "muon":
        return
    if grouped_experts:
        raise ConfigError(f"{flag}: muon steps 2-D matrices, and gpt.grouped_experts stacks "
                          "the experts' into 3-D tensors, which torch.optim.Muon does not take; "
                          "set gpt.grouped_experts false (each expert its own matrices, no "
                          f"parallel.ep) or choose {flag} adamw")
    if states_on_disk:
        raise ConfigError(f"{flag}: muon steps each matrix whole, and parallel.offload "
                          "disk:PATH steps the optimizer states a chunk of elements at a time, "
                          "which only an elementwise update allows; choose parallel.offload "
                          f"cpu, or {flag} adamw")


def _check_offload_fraction(offload: str) -> None:
    """cpu:FRACTION and disk:PATH:FRACTION need a number in (0, 1] (Note [which blocks a
    fraction offloads])."""
    try:
        if offload.startswith("cpu:"):
            parse_fraction(offload[4:])
        elif offload.startswith("disk:"):
            disk_path_and_fraction(offload[5:])
    except ValueError as e:
        raise ConfigError(f"parallel.offload: {e}") from None


def _check_step_in_backward(cfg: TrainConfig) -> None:
    """parallel.step_in_backward steps offloaded blocks on OverlappedStep's host thread
    during backward (Note [the host step overlapped with backward]): refuse it where no
    block is stepped there, or where the step needs what exists only after backward."""
    parallel = cfg.parallel
    if not parallel.step_in_backward:
        return
    if parallel.offload == "none":
        raise ConfigError("parallel.step_in_backward: steps the offloaded blocks on a host "
                          "thread during backward, and parallel.offload none offloads none; "
                          "use parallel.offload cpu, cpu:FRACTION or disk:PATH, or leave "
                          "step_in_backward false")
    after = ([f"the gradient clip (optim.grad_clip {cfg.optim.grad_clip})"]
             if cfg.optim.grad_clip > 0 else []) \
        + (["the fp16 loss scale (parallel.precision fp16)"]
           if parallel.precision == "fp16" else [])
    if after:
        raise ConfigError(f"parallel.step_in_backward: a block stepped during backward cannot "
                          f"apply {' or '.join(after)}, known only after the whole backward; "
                          "set optim.grad_clip 0 and a precision other than fp16, or leave "
                          "step_in_backward false")
    if not parallel.overlap_step or parallel.delayed_update >= 0:
        raise ConfigError("parallel.step_in_backward: runs on the host thread of "
                          "parallel.overlap_step true with parallel.delayed_update -1 (the "
                          "delayed update hands each block out in the step, after copying "
                          "what the next forward reads); set both so, or leave "
                          "step_in_backward false")


def _check_delayed_update(cfg: TrainConfig) -> None:
    """parallel.delayed_update delays the step of the blocks OverlappedStep steps on its host
    thread (Note [the delayed update]): refuse it where there are none, rather than train
    exactly under a flag that says otherwise, or delay only some of the model."""
    parallel = cfg.parallel
    if parallel.delayed_update < 0:
        return
    missing = ([f"parallel.offload {parallel.offload} (it needs cpu or cpu:FRACTION)"]
               if not parallel.offload.startswith("cpu") else []) \
        + (["parallel.overlap_step false"] if not parallel.overlap_step else []) \
        + ([f"optim.name {cfg.optim.name} (Muon steps the hidden matrices exactly, in the "
            "optimizer step)"] if cfg.optim.name != "adamw" else [])
    if missing:
        raise ConfigError(f"parallel.delayed_update {parallel.delayed_update}: delays the step "
                          f"of the CPU-offloaded blocks on the host thread, and with "
                          f"{' and '.join(missing)} no block or only some would be delayed; "
                          "use parallel.offload cpu or cpu:FRACTION, overlap_step true and "
                          "optim.name adamw, or leave delayed_update -1")


def _check_expert_parallel(cfg: TrainConfig) -> None:
    """parallel.ep splits the built-in GPT's grouped experts; the world size is checked
    at launch (train/model.py build_mesh)."""
    ep, gpt = cfg.parallel.ep, cfg.gpt
    if ep == 1:
        return
    if cfg.is_hf or not gpt.n_experts or not gpt.grouped_experts:
        has = ("a Hugging Face model" if cfg.is_hf else "gpt.n_experts 0" if not gpt.n_experts
               else "gpt.grouped_experts false")
        raise ConfigError(f"parallel.ep: {ep} splits the experts of the GPT with gpt.n_experts "
                          f"and gpt.grouped_experts true over ranks; this run has {has}: leave "
                          "parallel.ep at 1, or use --preset moe")
    if gpt.n_experts % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide gpt.n_experts {gpt.n_experts}; "
                          "give a divisor of it")
    if cfg.parallel.strategy not in ("full_shard", "shard_grad_op"):
        raise ConfigError(f"parallel.ep: {ep} runs with parallel.strategy full_shard or "
                          f"shard_grad_op, not {cfg.parallel.strategy}; choose one of those or "
                          "leave parallel.ep at 1")


def sections(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """(prefix, dataclass) pairs: the top level ("") then each section ("optim." ...)."""
    return [("", cfg)] + [(f"{name}.", getattr(cfg, name)) for name in SECTIONS]


def scalar_fields(obj: Any) -> list[dataclasses.Field]:
    """The fields of ``obj`` that hold values (not nested sections)."""
    return [f for f in dataclasses.fields(obj) if f.name not in SECTIONS]


# -- presets ---------------------------------------------------------------------------

DEFAULT_PRESET = "shakespeare"
# Presets sized for GPUs: the launcher prints their estimated peak memory per rank first.
GPU_PRESETS = ("gpt2-124m", "llama-1b")

PRESETS: dict[str, TrainConfig] = {
    "debug": TrainConfig(
        steps=60,
        gpt=PRESET_SHAPES["debug"],
        batch=BatchConfig(seq_len=32, batch_size=4),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5, decay_steps=60),
        eval=EvalConfig(every=20, batches=2, sample_tokens=60),
        checkpoint=CheckpointConfig(every=20),
    ),
    "shakespeare": TrainConfig(
        steps=400,
        gpt=PRESET_SHAPES["shakespeare"],
        batch=BatchConfig(seq_len=128, batch_size=16),
        optim=OptimConfig(lr=2e-3, min_lr=2e-4, warmup_steps=30, decay_steps=400),
        eval=EvalConfig(every=100, batches=4, sample_tokens=300),
        checkpoint=CheckpointConfig(every=200),
    ),
    # A small Mixtral-style mixture of experts (8 experts per block, top-2 routing, a
    # load-balancing loss): ~2.4M parameters of which ~0.8M compute each token; with few
    # sequences per rank an expert often gets no token on one rank and some on another.
    "moe": TrainConfig(
        steps=300,
        gpt=PRESET_SHAPES["moe"],
        batch=BatchConfig(seq_len=64, batch_size=16),
        optim=OptimConfig(lr=2e-3, min_lr=2e-4, warmup_steps=30, decay_steps=300),
        eval=EvalConfig(every=100, batches=4, sample_tokens=300),
        checkpoint=CheckpointConfig(every=150),
    ),
    "gpt2-124m": TrainConfig(
        steps=19073,
        gpt=PRESET_SHAPES["gpt2-124m"],
        batch=BatchConfig(seq_len=1024, batch_size=8, grad_accum=8, val_fraction=0.01),
        optim=OptimConfig(lr=6e-4, min_lr=6e-5, warmup_steps=700, decay_steps=19073),
        parallel=ParallelConfig(precision="bf16"),
        eval=EvalConfig(every=250, batches=20),
        checkpoint=CheckpointConfig(every=1000),
    ),
    "llama-1b": TrainConfig(
        steps=20000,
        gpt=PRESET_SHAPES["llama-1b"],
        batch=BatchConfig(seq_len=2048, batch_size=4, grad_accum=8, val_fraction=0.01),
        optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2000, decay_steps=20000),
        parallel=ParallelConfig(precision="bf16", activation_checkpointing=True),
        eval=EvalConfig(every=500, batches=10),
        checkpoint=CheckpointConfig(every=1000),
    ),
}


def get_preset(name: str) -> TrainConfig:
    """A copy of preset ``name`` (edit it freely)."""
    if name not in PRESETS:
        raise ConfigError(f"preset: accepted values are {', '.join(PRESETS)}; got {name!r}")
    return copy.deepcopy(PRESETS[name])


# -- the configuration as TOML (read back by flags.load_toml) ---------------------------

def to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as TOML that ``flags.load_toml`` reads back to an equal config (None, which
    TOML lacks, is written as "auto", which every field that may be None reads back)."""
    data = dataclasses.asdict(cfg)
    for table in [data] + [data[name] for name in SECTIONS]:
        table.update({k: "auto" for k, v in table.items() if v is None})
    return "# fullshard train: the resolved configuration of this run\n" + tomli_w.dumps(data)
