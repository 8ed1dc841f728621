"""Model shapes a projection works on: parameters and FLOPs per unit.

A model is a list of units as fullshard shards it: the root (token embedding, and the
output head when it is tied to it), one unit per block, and the tail (final norm and an
untied head) — torchtitan's ``[norm, output]`` unit. FLOPs follow the convention
torchtitan and PaLM use for MFU: 2 per parameter of every matrix a token passes through in
forward, 4·s·d per layer for attention's two matmuls (s the sequence length, d the
attention width, causal masking not discounted), and backward twice forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..gpt import PRESET_SHAPES, GPTConfig
from .hardware import ProjectionError


@dataclass(frozen=True)
class ModelShape:
    name: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    tied: bool
    gated_mlp: bool           # SwiGLU: three matrices; GELU MLP: two
    learned_positions: int = 0  # rows of a learned position table (GPT-2), 0 for RoPE
    head_dim: int = 0           # 0: d_model / n_heads (a few models, Gemma, choose another)

    def __post_init__(self) -> None:
        for field in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                      "vocab_size"):
            if getattr(self, field) < 1:
                raise ProjectionError(f"model shape {self.name!r}: {field} must be positive, "
                                      f"got {getattr(self, field)}")
        if (not self.head_dim and self.d_model % self.n_heads) \
                or self.n_heads % self.n_kv_heads:
            raise ProjectionError(
                f"model shape {self.name!r}: {self.n_heads} heads must divide d_model "
                f"{self.d_model} and be a multiple of the {self.n_kv_heads} key/value heads")

    # -- parameters ----------------------------------------------------------------------
    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def q_width(self) -> int:
        """The width of the queries (and of attention's output): heads x head dimension."""
        return self.head_width * self.n_heads

    @property
    def kv_width(self) -> int:
        return self.head_width * self.n_kv_heads

    @property
    def block_matrix_params(self) -> int:
        d, f = self.d_model, self.ffn_hidden
        attention = 2 * d * self.q_width + 2 * d * self.kv_width
        return attention + (3 if self.gated_mlp else 2) * d * f

    @property
    def block_params(self) -> int:
        return self.block_matrix_params + 2 * self.d_model  # two norms

    @property
    def embedding_params(self) -> int:
        return (self.vocab_size + self.learned_positions) * self.d_model

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab_size * self.d_model

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.n_layers * self.block_params + self.head_params \
            + self.d_model

    # -- FLOPs per token -----------------------------------------------------------------
    def block_forward_flops(self, seq: int) -> float:
        return 2 * self.block_matrix_params + 4 * seq * self.q_width

    @property
    def head_forward_flops(self) -> float:
        return 2 * self.vocab_size * self.d_model

    def model_flops_per_token(self, seq: int) -> float:
        """Forward and backward, no recomputation: the numerator of MFU."""
        return 3 * (self.n_layers * self.block_forward_flops(seq) + self.head_forward_flops)


def _from_gpt(name: str, cfg: GPTConfig) -> ModelShape:
    return ModelShape(name, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_heads,
                      cfg.mlp_ratio * cfg.d_model, cfg.vocab_size, cfg.tie_embeddings,
                      gated_mlp=False, learned_positions=cfg.seq_len)


# Published architectures (their papers' / model cards' dimensions) and fullshard's presets.
SHAPES: dict[str, ModelShape] = {
    "llama2-7b": ModelShape("llama2-7b", 4096, 32, 32, 32, 11008, 32000, False, True),
    "llama2-13b": ModelShape("llama2-13b", 5120, 40, 40, 40, 13824, 32000, False, True),
    "llama3-8b": ModelShape("llama3-8b", 4096, 32, 32, 8, 14336, 128256, False, True),
    "llama3-70b": ModelShape("llama3-70b", 8192, 80, 64, 8, 28672, 128256, False, True),
    **{name: _from_gpt(name, cfg) for name, cfg in PRESET_SHAPES.items()},
}


def shape_named(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ProjectionError(f"unknown model {name!r}: one of {', '.join(SHAPES)}") from None


def shape_of(cfg: GPTConfig, name: str = "gpt") -> ModelShape:
    """The shape of a fullshard GPT (``fullshard.gpt.GPTConfig``)."""
    return _from_gpt(name, cfg)


# Hugging Face config.json keys of each dimension, by family (the first present is read)
_HF_KEYS = {
    "d_model": ("hidden_size", "n_embd", "d_model"),
    "n_layers": ("num_hidden_layers", "n_layer", "n_layers"),
    "n_heads": ("num_attention_heads", "n_head", "n_heads"),
    "n_kv_heads": ("num_key_value_heads",),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_dim"),
    "vocab_size": ("vocab_size",),
    "head_dim": ("head_dim",),
}
# families whose MLP is not gated (GELU), and those that tie the output head by default
_UNGATED = {"gpt2", "gpt_neox", "gptj", "mpt", "opt", "bloom", "falcon", "gpt_bigcode", "phi"}
_TIED = {"gpt2", "mpt", "gemma", "gemma2", "gemma3_text", "gpt_bigcode"}
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def hf_shape_fields(config: dict, where: str) -> dict:
    """The ModelShape fields a Hugging Face ``config.json`` gives (a field it lacks is left
    out: the caller names the flag that supplies it)."""
    for key in _EXPERTS:
        if config.get(key):
            raise ProjectionError(f"{where} is a mixture-of-experts model ({key} "
                                  f"{config[key]}): the projection models dense blocks only")
    kind = str(config.get("model_type", ""))
    out = {}
    for field, keys in _HF_KEYS.items():
        found = [config[k] for k in keys if isinstance(config.get(k), int)]
        if found:
            out[field] = found[0]
    if "ffn_hidden" not in out and "d_model" in out:
        if isinstance(config.get("expansion_ratio"), (int, float)):  # MPT
            out["ffn_hidden"] = int(config["expansion_ratio"] * out["d_model"])
        elif kind in _UNGATED:
            out["ffn_hidden"] = 4 * out["d_model"]
    if "n_kv_heads" not in out and "n_heads" in out:
        out["n_kv_heads"] = 1 if config.get("multi_query") else out["n_heads"]
    out["gated_mlp"] = kind not in _UNGATED
    out["tied"] = bool(config.get("tie_word_embeddings", kind in _TIED))
    if kind == "gpt2":
        out["learned_positions"] = int(config.get("n_positions", 1024))
    elif kind == "mpt" and not (config.get("attn_config") or {}).get("alibi"):
        out["learned_positions"] = int(config.get("max_seq_len", 2048))
    return out
