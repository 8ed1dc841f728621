"""The trainer's configuration: typed dataclasses, one docstring per field.

A run is described by one :class:`TrainConfig`: a preset (``presets.py``), then a TOML
file (``--config``), then command-line overrides (``--optim.lr 1e-3``) are applied in
that order. The docstring under each field is what ``fullshard train --help`` prints.
Fields that take one of a few values name them in ``choices`` metadata; fields with a
lower bound name it in ``min``: :func:`validate` checks both and the cross-field rules,
raising :class:`ConfigError` with a one-line message that names the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..gpt import GPTConfig

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A configuration value that is not accepted; the message is one line."""


@dataclass
class BatchConfig:
    """What one optimizer step reads."""

    seq_len: int = field(default=256, metadata={"min": 1})
    """Tokens per training sequence (for GPT models at most gpt.seq_len)."""
    batch_size: int = field(default=16, metadata={"min": 1})
    """Sequences per rank in one micro-batch."""
    grad_accum: int = field(default=1, metadata={"min": 1})
    """Micro-batches per optimizer step; gradients are reduced once, after the last."""
    val_fraction: float = field(default=0.1, metadata={"min": 0.0})
    """Share of the text, taken from its end, held out for validation."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay."""

    lr: float = field(default=1e-3, metadata={"min": 0.0})
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = field(default=1e-4, metadata={"min": 0.0})
    """Learning rate at the end of the cosine decay, and after it."""
    warmup_steps: int = field(default=100, metadata={"min": 0})
    """Steps of linear warmup from 0 to lr."""
    decay_steps: int = field(default=0, metadata={"min": 0})
    """Step at which the cosine decay reaches min_lr (0: the run's steps). Fixed when a run
    starts and kept on --resume, so extending a run does not rewrite its past schedule."""
    weight_decay: float = field(default=0.1, metadata={"min": 0.0})
    """Decoupled weight decay, applied to matrices only (not to biases, norms)."""
    beta1: float = field(default=0.9, metadata={"min": 0.0})
    """AdamW beta1."""
    beta2: float = field(default=0.95, metadata={"min": 0.0})
    """AdamW beta2."""
    grad_clip: float = field(default=1.0, metadata={"min": 0.0})
    """Clip the global gradient norm to this value (0: no clipping)."""


@dataclass
class ParallelConfig:
    """How the model is sharded and computed."""

    strategy: str = field(default="full_shard", metadata={"choices": STRATEGIES})
    """full_shard (ZeRO-3), shard_grad_op (ZeRO-2: parameters stay gathered from forward
    to backward), hybrid_shard (shard within a replica group, replicate across groups),
    no_shard (every rank holds everything, gradients all-reduced: DDP)."""
    reshard_after_forward: bool | int | None = None
    """Override the strategy's reshard_after_forward: true, false, or an int N dividing
    the shard group size (keep parameters sharded N ways for backward); auto: the
    strategy's."""
    replicas: int = field(default=0, metadata={"min": 0})
    """hybrid_shard: number of replica groups (0: one per node)."""
    precision: str = field(default="fp32", metadata={"choices": PRECISIONS})
    """Compute dtype. bf16 and fp16 gather and compute in that dtype and reduce gradients
    in fp32; parameters and optimizer states stay fp32. fp16 scales the loss."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of storing them."""


@dataclass
class EvalConfig:
    """Validation and the text sample printed at the end."""

    every: int = field(default=50, metadata={"min": 0})
    """Evaluate every this many steps, at step 0 and at the last step (0: only those)."""
    batches: int = field(default=8, metadata={"min": 1})
    """Validation micro-batches per rank per evaluation (the same ones every time)."""
    sample_tokens: int = field(default=300, metadata={"min": 0})
    """Tokens generated for the sample printed at the end (0: no sample)."""
    sample_prompt: str = "\n"
    """Text the sample starts from."""
    temperature: float = field(default=0.8, metadata={"min": 0.0})
    """Sampling temperature (0: always the most likely token)."""


@dataclass
class CheckpointConfig:
    """Checkpoints: written under OUT/checkpoints, OUT/checkpoints/latest names the newest."""

    every: int = field(default=100, metadata={"min": 0})
    """Save every this many steps (0: only at the end); one is always saved at the end
    and on Ctrl-C."""
    keep: int = field(default=2, metadata={"min": 1})
    """Number of most recent checkpoints kept; older ones are deleted."""


@dataclass
class TrainConfig:
    """One training run."""

    model: str = "gpt"
    """gpt (the GPT whose shape is [gpt]) or hf:PATH (a Hugging Face causal LM folder)."""
    data: str = "tinyshakespeare"
    """tinyshakespeare (shipped with fullshard), or a path to plain text or to JSONL whose
    lines hold a "text" field."""
    steps: int = field(default=1000, metadata={"min": 1})
    """Optimizer steps in the run (on --resume: the total, counting the steps done)."""
    seed: int = 0
    """Seeds the initial weights, the data order and the sample."""
    gpt: GPTConfig = field(default_factory=GPTConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def is_hf(self) -> bool:
        return self.model.startswith("hf:")

    @property
    def hf_path(self) -> str:
        return self.model[len("hf:"):]


SECTIONS = ("gpt", "batch", "optim", "parallel", "eval", "checkpoint")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every field's choices and bounds and the rules between fields; return cfg."""
    for prefix, obj in [("", cfg)] + [(f"{s}.", getattr(cfg, s)) for s in SECTIONS]:
        for f in dataclasses.fields(obj):
            _check_field(prefix + f.name, getattr(obj, f.name), f.metadata)
    for f in dataclasses.fields(GPTConfig):  # model.py carries no metadata: all positive
        value = getattr(cfg.gpt, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"gpt.{f.name}: must be >= 1, got {value}")
    if cfg.model != "gpt" and not cfg.is_hf:
        raise ConfigError(f"model: accepted values are gpt or hf:PATH, got {cfg.model!r}")
    if not cfg.is_hf and cfg.batch.seq_len > cfg.gpt.seq_len:
        raise ConfigError(f"batch.seq_len: {cfg.batch.seq_len} exceeds gpt.seq_len "
                          f"{cfg.gpt.seq_len}, the positions the model has")
    if not 0.0 <= cfg.batch.val_fraction < 1.0:
        raise ConfigError(f"batch.val_fraction: must be in [0, 1), got {cfg.batch.val_fraction}")
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr: {cfg.optim.min_lr} is above optim.lr {cfg.optim.lr}")
    raf = cfg.parallel.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool) and raf < 1:
        raise ConfigError(f"parallel.reshard_after_forward: accepted values are true, false, "
                          f"auto or an int >= 1, got {raf}")
    return cfg


def _check_field(name: str, value, metadata) -> None:
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}: accepted values are {', '.join(choices)}; got {value!r}")
    low = metadata.get("min")
    if low is not None and value < low:
        raise ConfigError(f"{name}: must be >= {low}, got {value}")
