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
    # a mixture of experts: every block's MLP is n_experts expert MLPs (each of width
    # expert_ffn_hidden, 0: ffn_hidden) and a router; a token runs top_k of them
    n_experts: int = 0
    top_k: int = 1
    expert_ffn_hidden: int = 0

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
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ProjectionError(f"model shape {self.name!r}: top_k {self.top_k} experts a "
                                  f"token must be between 1 and n_experts {self.n_experts}")

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
    def mlp_width(self) -> int:
        """The hidden width of one MLP (of one expert's)."""
        return self.expert_ffn_hidden or self.ffn_hidden

    @property
    def mlp_matrix_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.d_model * self.mlp_width

    @property
    def mlps_per_token(self) -> int:
        """The MLPs one token runs through in a block: its top_k experts, or the one MLP."""
        return self.top_k if self.n_experts else 1

    def _block_matrices(self, mlps: int) -> int:
        d = self.d_model
        attention = 2 * d * self.q_width + 2 * d * self.kv_width
        return attention + mlps * self.mlp_matrix_params + d * self.n_experts  # + router

    @property
    def block_matrix_params(self) -> int:
        """Every matrix parameter of a block (all of its experts)."""
        return self._block_matrices(max(self.n_experts, 1))

    @property
    def block_active_matrix_params(self) -> int:
        """The matrix parameters one token computes with in a block (its top_k experts)."""
        return self._block_matrices(self.mlps_per_token)

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
        """Every parameter: what is sharded, gathered, reduced and stepped."""
        return self.embedding_params + self.n_layers * self.block_params + self.head_params \
            + self.d_model

    @property
    def active_params(self) -> int:
        """The parameters one token computes with (a mixture of experts: its top_k)."""
        return self.num_params - self.n_layers * (self.block_matrix_params
                                                  - self.block_active_matrix_params)

    # -- FLOPs per token -----------------------------------------------------------------
    def block_forward_flops(self, seq: int) -> float:
        return 2 * self.block_active_matrix_params + 4 * seq * self.q_width

    @property
    def head_forward_flops(self) -> float:
        return 2 * self.vocab_size * self.d_model

    def model_flops_per_token(self, seq: int) -> float:
        """Forward and backward, no recomputation: the numerator of MFU."""
        return 3 * (self.n_layers * self.block_forward_flops(seq) + self.head_forward_flops)


def _from_gpt(name: str, cfg: GPTConfig) -> ModelShape:
    return ModelShape(name, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_heads,
                      cfg.mlp_ratio * cfg.d_model, cfg.vocab_size, cfg.tie_embeddings,
                      gated_mlp=False, learned_positions=cfg.seq_len,
                      n_experts=cfg.n_experts, top_k=cfg.top_k if cfg.n_experts else 1)


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
# what a mixture of experts may have beyond routed experts in every block, which the
# projection does not model (DeepSeek's shared experts and leading dense blocks, Qwen2-MoE's
# shared expert, Qwen3-MoE's dense layers)
_UNMODELLED_MOE = ("n_shared_experts", "shared_expert_intermediate_size",
                   "first_k_dense_replace", "mlp_only_layers")


def _expert_fields(config: dict, where: str) -> dict:
    """A mixture of experts' fields: every block routed, each token to its top-k experts
    (Mixtral, Qwen3-MoE, gpt-oss); what else a family has is refused by name."""
    key = next((k for k in _EXPERTS if config.get(k)), None)
    if key is None:
        return {}
    extra = [f"{k} {config[k]}" for k in _UNMODELLED_MOE if config.get(k)]
    if config.get("decoder_sparse_step", 1) != 1:
        extra.append(f"decoder_sparse_step {config['decoder_sparse_step']}")
    if extra:
        raise ProjectionError(
            f"{where} is a mixture of experts with {', '.join(extra)}: the projection models "
            "every block routed to its top-k experts, without shared experts or dense blocks")
    top_k = config.get("num_experts_per_tok") or config.get("experts_per_token")
    if not isinstance(top_k, int):
        raise ProjectionError(f"{where} has {key} {config[key]} but no num_experts_per_tok: "
                              "the experts each token runs are needed to count its FLOPs")
    out = {"n_experts": int(config[key]), "top_k": top_k}
    if isinstance(config.get("moe_intermediate_size"), int):
        out["expert_ffn_hidden"] = config["moe_intermediate_size"]
    return out


def hf_shape_fields(config: dict, where: str) -> dict:
    """The ModelShape fields a Hugging Face ``config.json`` gives (a field it lacks is left
    out: the caller names the flag that supplies it)."""
    kind = str(config.get("model_type", ""))
    out = _expert_fields(config, where)
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
