"""``Settings``: what a projected run does per rank (strategy, batch, checkpointing, dtypes,
quantized communication, attention kernel, compilation, fused kernels)."""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import ProjectionError

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
CHECKPOINTING = ("none", "selective", "full")
QUANTIZE = ("none", "weights", "grads", "weights,grads")
ATTENTION_KERNELS = ("flash2", "flash1")  # flash attention's generation (compute.py)
# what torch.compile wraps: nothing, each block (torchtitan), the whole model (compute.py)
COMPILE = ("none", "blocks", "model")
# the blocks' elementwise kernels: PyTorch's eager ones, or hand-written fused ones (compute.py)
KERNELS = ("eager", "fused")


@dataclass(frozen=True)
class Settings:
    strategy: str = "full_shard"
    batch: int = 1                 # sequences per rank per micro-batch
    seq: int = 2048
    grad_accum: int = 1
    checkpointing: str = "none"    # "full": whole blocks; "selective": torchtitan's op policy
    param_bytes: int = 2           # compute dtype of gathered parameters (bf16)
    reduce_bytes: int = 4          # gradient reduction dtype (fp32)
    quantize: str = "none"         # int8 all-gathers / reduce-scatters (--parallel.quantize)
    checkpoint_every: int = 1      # with "full": every n-th block (torchtitan's "selective layer")
    # Reduce after every micro-batch (FSDP1 without no_sync, as Composer runs it); False is
    # fullshard's trainer: only the last reduces, the ones before accumulate unsharded
    # gradients in the reduce dtype (memory for every parameter, time to add them)
    sync_micro_batches: bool = False
    # A fused cross-entropy (flash-attn's: bf16 logits and their gradient) instead of fp32
    # logits, their log-softmax and its gradient (fullshard's trainer, torchtitan): memory
    fused_loss: bool = False
    # Expert parallelism (torchtitan's EP x efsdp): each block's experts split over ``ep``
    # consecutive ranks of its shard group, each expert sharded over the group's other
    # dimension (shard ranks / ep); tokens reach their experts by all-to-all
    ep: int = 1
    # flash attention's generation: "flash2" (SDPA, flash-attn 2) or "flash1" (FlashAttention
    # 1, its Triton port): Note [attention by kernel, not by sequence length] (compute.py)
    attention: str = "flash2"
    # torch.compile over "blocks" (each block compiled, torchtitan's) or the whole "model":
    # its fused kernels move fewer bytes and launch fewer times (Note [what compilation
    # saves], compute.py)
    compile: str = "none"
    # "fused": the blocks' norms, rotary embedding and activation run as hand-written fused
    # kernels (flash-attn's RMSNorm and rotary, xformers' or Liger's SwiGLU), which fuse what
    # torch.compile fuses (Note [what compilation saves], compute.py)
    kernels: str = "eager"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ProjectionError(f"strategy must be one of {', '.join(STRATEGIES)}, "
                                  f"got {self.strategy!r}")
        if self.quantize not in QUANTIZE:
            raise ProjectionError(f"quantize must be one of {', '.join(QUANTIZE)}, got "
                                  f"{self.quantize!r}")
        if self.quantize != "none" and self.strategy == "no_shard":
            raise ProjectionError("quantize applies to all-gathers and reduce-scatters, "
                                  "which no_shard does not issue")
        for name, names, what in (("attention", ATTENTION_KERNELS, "flash attention's generation"),
                                  ("compile", COMPILE, "what torch.compile wraps"),
                                  ("kernels", KERNELS, "the blocks' elementwise kernels")):
            if getattr(self, name) not in names:
                raise ProjectionError(f"{name} must be one of {', '.join(names)} ({what}), "
                                      f"got {getattr(self, name)!r}")
        if self.checkpointing not in CHECKPOINTING:
            raise ProjectionError(f"activation checkpointing must be one of "
                                  f"{', '.join(CHECKPOINTING)}, got {self.checkpointing!r}")
        for name in ("batch", "seq", "grad_accum", "param_bytes", "reduce_bytes",
                     "checkpoint_every", "ep"):
            if getattr(self, name) < 1:
                raise ProjectionError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def fused_blocks(self) -> bool:
        """Whether the blocks' elementwise chains run fused: compiled, or hand-fused."""
        return self.compile != "none" or self.kernels == "fused"

    def checkpointed(self, block: int) -> bool:
        """Whether whole-block checkpointing drops block ``block``'s activations."""
        return self.checkpointing == "full" and block % self.checkpoint_every == 0
