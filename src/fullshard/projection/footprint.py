"""Memory per rank of a projected run (Note [what the projection models], memory)."""

from __future__ import annotations

from .costs import gathered_params, shard_ranks
from .hardware import Cluster
from .settings import Settings
from .shapes import ModelShape

STATE_BYTES_PER_PARAM = 16  # fp32 parameter, gradient, two moments
# per token and vocabulary entry at the loss's peak (the start of backward): fp32 logits'
# log-softmax (kept for backward), the NLL's gradient and the log-softmax's, all fp32; a
# fused loss (flash-attn's cross-entropy, as llm-foundry's MPT runs it) bf16 logits and
# their bf16 gradient
LOSS_BYTES, FUSED_LOSS_BYTES = 12, 4


def memory_per_rank(shape: ModelShape, cluster: Cluster, s: Settings) -> int:
    """Note [what the projection models], memory."""
    shard, _, _ = shard_ranks(cluster, s.strategy)
    params = gathered_params(shape, cluster, s)  # with --ep, 1/ep of the experts
    states = STATE_BYTES_PER_PARAM * shape.num_params / shard
    if s.strategy in ("shard_grad_op", "no_shard"):
        gathered = sum(params) * s.param_bytes
    else:
        gathered = 2 * max(params) * s.param_bytes + max(params) * s.reduce_bytes
    d, f, q, kv = shape.d_model, shape.ffn_hidden, shape.q_width, shape.kv_width
    per_token = 3 * d + 2 * q + 2 * kv + (4 if shape.gated_mlp else 2) * f
    tokens = s.batch * s.seq
    act = 2  # bytes of the compute dtype
    block = tokens * per_token * act
    kept = sum(tokens * d * act if s.checkpointed(i) else block
               for i in range(shape.n_layers))
    if s.checkpointing == "full":
        activations = kept + block
    elif s.checkpointing == "selective":
        activations = shape.n_layers * block / 2
    else:
        activations = shape.n_layers * block
    logits = tokens * shape.vocab_size * (FUSED_LOSS_BYTES if s.fused_loss else LOSS_BYTES)
    # fullshard's trainer accumulates unsharded gradients between reductions
    accumulators = 0 if s.sync_micro_batches or s.grad_accum == 1 \
        else shape.num_params * s.reduce_bytes
    return int(states + gathered + activations + logits + accumulators)
