"""The trainer's configuration: typed dataclasses, one docstring per field; the named
presets; reading and writing it as TOML and ``--section.field`` strings.

A run is described by one :class:`TrainConfig`: a preset (:data:`PRESETS`), then a TOML
file (``--config``), then command-line overrides (``--optim.lr 1e-3``) are applied in
that order. The docstring under each field is what ``fullshard train --help`` prints.
Fields that take one of a few values name them in ``choices`` metadata; fields with a
lower bound name it in ``min``: :func:`validate` checks both and the cross-field rules,
raising :class:`ConfigError` with a one-line message that names the field.

Named training configurations (and the model each one builds: ``model.build_model``).
``PRESETS[name]`` is a complete :class:`TrainConfig`; ``--config`` files and command-line
flags are applied on top of a copy (:func:`get_preset`). The model shape of a preset is a
plain :class:`GPTConfig` (``fullshard.gpt.PRESET_SHAPES``), so a preset can be sized
without training it::

    from fullshard.train.config import PRESETS
    from fullshard.train.model import build_model
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

Reading and writing :class:`TrainConfig`: TOML files, ``--section.field`` strings, help.
TOML mirrors the dataclasses: top-level fields first, then one table per section::

    steps = 600
    [optim]
    lr = 0.002

A field whose value is None (``parallel.reshard_after_forward = auto``) is written as a
comment, since TOML has no null.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..gpt import PRESET_SHAPES, GPTConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML with the tomli backport
    import tomli as tomllib

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
PRECISIONS = ("fp32", "bf16", "fp16")
WANDB_FORBIDDEN = "/\\#?%:"  # characters W&B refuses in a project name


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
    compile: bool = False
    """Compile each transformer block with torch.compile before sharding (one graph per
    block; fullshard's gathers and reductions run between them)."""
    offload: bool = False
    """Keep parameters, gradients and optimizer states in CPU memory (CPU offload); the
    optimizer steps there, fused. For models that do not fit the devices otherwise."""


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
class MetricsConfig:
    """Where metrics go besides OUT/metrics.jsonl and OUT/loss.png (rank 0 writes them)."""

    tensorboard: bool = False
    """Also write TensorBoard event files to OUT (view with tensorboard --logdir OUT); needs
    pip install 'fullshard[tensorboard]'."""
    wandb: str = ""
    """Also log to this Weights & Biases project (empty: off; WANDB_MODE=offline logs to
    OUT/wandb without an account); needs pip install 'fullshard[wandb]'."""


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
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def is_hf(self) -> bool:
        return self.model.startswith("hf:")

    @property
    def hf_path(self) -> str:
        return self.model[len("hf:"):]


SECTIONS = ("gpt", "batch", "optim", "parallel", "eval", "checkpoint", "metrics")


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
    if set(WANDB_FORBIDDEN) & set(cfg.metrics.wandb) or len(cfg.metrics.wandb) > 128:
        raise ConfigError(f"metrics.wandb: a W&B project name of at most 128 characters, "
                          f"without any of {' '.join(WANDB_FORBIDDEN)}; got "
                          f"{cfg.metrics.wandb!r}")
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


# -- TOML files and command-line strings -----------------------------------------------

_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}
_NONE = {"auto", "none"}


def sections(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """(prefix, dataclass) pairs: the top level ("") then each section ("optim." ...)."""
    return [("", cfg)] + [(f"{name}.", getattr(cfg, name)) for name in SECTIONS]


def scalar_fields(obj: Any) -> list[dataclasses.Field]:
    """The fields of ``obj`` that hold values (not nested sections)."""
    return [f for f in dataclasses.fields(obj) if f.name not in SECTIONS]


@functools.lru_cache(maxsize=None)
def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal written on the line after it."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def describe_type(hint: Any) -> str:
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    words = {bool: "true/false", int: "an int", float: "a number", str: "text",
             type(None): "auto"}
    return " or ".join(words[o] for o in options)


def metavar(hint: Any) -> str:
    """How ``--help`` shows a field's value: INT, NUMBER, TEXT, BOOL, BOOL|INT|auto."""
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    words = {bool: "BOOL", int: "INT", float: "NUMBER", str: "TEXT", type(None): "auto"}
    return "|".join(words[o] for o in options)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def parse_value(name: str, text: str, hint: Any) -> Any:
    """Turn the command-line string for field ``name`` into a value of type ``hint``."""
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    word = text.strip().lower()
    if type(None) in options and word in _NONE:
        return None
    if bool in options and word in _TRUE | _FALSE:
        return word in _TRUE
    if int in options:
        try:
            return int(text)
        except ValueError:
            pass
    if float in options:
        try:
            value = float(text)
            if math.isfinite(value):
                return value
        except ValueError:
            pass
    if str in options:
        return text
    raise ConfigError(f"{name}: expected {describe_type(hint)}, got {text!r}")


def check_value(name: str, value: Any, hint: Any) -> Any:
    """Accept a TOML value for field ``name`` if its type fits ``hint`` (ints as floats)."""
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    if isinstance(value, bool):
        if bool in options:
            return value
    elif isinstance(value, int) and int in options:
        return value
    elif isinstance(value, (int, float)) and float in options:
        return float(value)
    elif isinstance(value, str) and str in options:
        return value
    raise ConfigError(f"{name}: expected {describe_type(hint)}, got {value!r}")


def apply_overrides(cfg: TrainConfig, values: dict[str, Any], source: str) -> TrainConfig:
    """A copy of ``cfg`` with ``{"optim.lr": value, ...}`` applied; values are strings from
    the command line or already-typed values from TOML."""
    updates: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        section, _, name = dotted.rpartition(".")
        if section and section not in SECTIONS:
            raise ConfigError(f"{source}: unknown field {dotted} (sections: "
                              f"{', '.join(SECTIONS)})")
        obj = getattr(cfg, section) if section else cfg
        if name not in _names(obj):
            raise ConfigError(f"{source}: unknown field {dotted} (fields there: "
                              f"{', '.join(sorted(_names(obj)))})")
        hint = type_hints(type(obj))[name]
        # Strings go through the parser: command-line text, and TOML's "auto" or "true".
        typed = (parse_value(dotted, value, hint) if isinstance(value, str)
                 else check_value(dotted, value, hint))
        updates.setdefault(section, {})[name] = typed
    top = updates.pop("", {})
    try:
        replaced = {s: dataclasses.replace(getattr(cfg, s), **u) for s, u in updates.items()}
    except ValueError as err:  # GPTConfig's own checks (d_model divisible by n_heads)
        raise ConfigError("gpt: " + str(err).splitlines()[0].removeprefix("GPTConfig: ")) from None
    return dataclasses.replace(cfg, **top, **replaced)


def _names(obj: Any) -> set[str]:
    return {f.name for f in scalar_fields(obj)}


def load_toml(cfg: TrainConfig, path: str) -> TrainConfig:
    """``cfg`` with the values of the TOML file at ``path`` applied."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise ConfigError(f"{path}: unknown section [{key}] (sections: "
                                  f"{', '.join(SECTIONS)})")
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return apply_overrides(cfg, flat, path)


def to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as TOML that :func:`load_toml` reads back to an equal config."""
    lines = ["# fullshard train: the resolved configuration of this run"]
    for prefix, obj in sections(cfg):
        if prefix:
            lines += ["", f"[{prefix[:-1]}]"]
        for f in scalar_fields(obj):
            value = getattr(obj, f.name)
            if value is None:
                lines.append(f"# {f.name} = \"auto\"")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a JSON string is a valid TOML basic string
