"""Seconds of compute per unit and pass: matrix multiplies, attention, memory-bound
elementwise work and the loss, each at the rate its kind of kernel reaches on the device.

Note [the compute model]
One achieved fraction of peak per device could not fit both a 125M model at 512 tokens and
a 70B model at 32k (published runs imply 0.40-0.76 on A100): small models spend their time
in elementwise kernels and the vocabulary's softmax, long sequences in attention, large ones
in big matrix multiplies. Each kind is modelled for what it is:

- **Matrix multiplies** (every Linear, forward; its input- and weight-gradient products in
  backward) as an additive roofline: ``2mkn / (peak x matmul) + bytes / (bandwidth x
  memory)``, bytes being the two operands and the result in bf16. Narrow layers (d = 768)
  sit near the ridge and run well below peak; wide ones (d = 8192) near ``matmul``; the
  same shape runs further from peak on an H100 (ridge 295 FLOP/byte) than on an A100 (153).
- **Attention** (flash attention, causal): its real FLOPs, 2·s·d per token forward (half of
  the 4·s·d that MFU counts) and 2.5 times that backward (the backward recomputes the
  scores), at ``attention`` of peak for a second-generation kernel (FlashAttention-2, which
  SDPA runs) and ``flash1`` times that for a first-generation one (FlashAttention 1 and its
  Triton port, ``Settings.attention``): Note [attention by kernel, not by sequence length].
  (A factor for the head dimension, 64 against 128, was tried and fitted to no effect.)
- **Elementwise work** (norms, activation, residual adds, rotary embedding, casts):
  ``elementwise`` bf16 passes over each token's d- and f-wide activations per block forward
  (d + f elements: the published shapes have f = 2.7d to 4d, so passes over the two cannot
  be told apart), twice that backward, at the device's memory bandwidth. Two kinds of block
  differ here: a GPT-style block (LayerNorm, GELU, learned positions: one fused
  kernel per norm) and a Llama-style one (RMSNorm, SwiGLU, rotary embedding: several eager
  kernels each, in fp32), told apart by the gated MLP.
- **The loss**: ``loss_bytes`` bytes per token and vocabulary entry (bf16 logits, their
  fp32 softmax and its gradient), half forward, half backward, at memory bandwidth.
- **Per-unit overhead**: ``unit_overhead`` seconds per unit per forward (twice per
  backward): kernel launches and the hooks around them, which small units do not hide.
- **Activation checkpointing** recomputes what it dropped: a checkpointed block runs its
  forward again (matrix multiplies, attention, elementwise); torchtitan's selective op
  policy recomputes every other matrix multiply and the elementwise work, not attention.

The constants differ by architecture where the kernels do (the matrix-multiply and
attention fractions of peak on Ampere and Hopper); the byte counts and overheads are shared.
Each was fitted by ``projection.fit`` to the fit half of ``published_runs.csv`` (see
docs/projection.md for the values and the error on the held-out half): FITTED is the output
of ``python -m fullshard.projection.fit``, rounded to four digits, with the unit overhead
at the prior's value because the fit half cannot pin it (Note [the prior]).

Note [the prior]
A fit judged on a source it never saw must not start from, or fall back to, constants that
source helped fit: PRIOR is where every fit starts, and what a constant keeps when the runs
being fitted cannot pin it (``fit.pinned``: its term takes under a tenth of the step in all
but two of them, e.g. the GPT-style block's elementwise passes when only Llama-style runs
are fitted). Each value is derived from datasheets and first principles, not from any
published run:

- ``matmul``: a large bf16 GEMM in cuBLAS sustains about 80% of the A100's 312 TFLOP/s; the
  H100 SXM's 989 TFLOP/s assume a boost clock that its 700 W limit does not hold under dense
  GEMMs, so about 70%.
- ``attention``: FlashAttention-2 reports 50-73% of the A100's peak forward and less
  backward (its paper, Dao 2023): 0.5; on the H100 it was not written for Hopper's
  instructions and reaches about a third of peak: 0.35.
- ``flash1``: the same paper's abstract puts FlashAttention 1 at 25-40% of the A100's peak
  and FlashAttention-2 at about twice its speed: 0.5.
- ``elementwise``: one read and one write per elementwise kernel over its tensors. A
  GPT-style block: two LayerNorms (2d each), GELU over f (2f), two residual adds (3d each):
  10d + 2f, with f = 4d, 3.6 passes over d + f. A Llama-style block in eager kernels: two
  RMSNorms that upcast to fp32, square, mean, scale, cast back and weight (about 18d in
  bf16-sized passes each), rotary embedding on q and k (about 12d), SwiGLU (silu 2f, the
  product 3f), two residual adds (6d): 54d + 5f, with f = 3.5d, 16 passes.
- ``loss_bytes``: an eager fp32 cross-entropy per vocabulary entry: the upcast (read 2,
  write 4), log-softmax (two reads of 4 for max and sum, one write of 4), its backward
  (read 4 + 4, write 4), the cast of the gradient back (read 4, write 2): 36 bytes.
- ``unit_overhead``: about 50 kernels per block forward at about 10 us of eager host
  dispatch each, with the unit's hooks: 0.5 ms.
- ``compile_saving``: the share of the eager elementwise passes and launches that
  torch.compile's fusion removes, counted as above: 0.67 (Note [what compilation saves]).

Note [attention by kernel, not by sequence length]
Fitted on the Llama-style sources (SDPA, 4k-8k tokens), attention came out at 0.59 of the
A100's peak, and MosaicML's runs at 16k-65k tokens were projected 41-44% too fast: their
attention implies 0.31. Sequence length is not what separates them. The attention fraction
each MosaicML run implies (every other constant held) is flat from 4k to 65k tokens: 0.32,
0.31, 0.32, 0.34, 0.34 on A100s with 128-wide heads, 0.22-0.18 on H100s, 0.36-0.30 with
64-wide heads, where attention takes 15-80% of a step (docs/projection.md); so a rate that
rises with length (the causal mask's half-filled diagonal tiles, a short sequence's softmax
at memory bandwidth: both fade by 4k tokens) or falls with it would not move those runs.
What separates them is the kernel: those runs used llm-foundry's Triton port of
FlashAttention 1 (its ``attn_impl: triton``). FlashAttention-2 (SDPA, flash-attn 2) does
fewer non-matrix-multiply FLOPs in its online softmax, splits the work over the sequence
as well as batch and heads, and keeps each warp on its own queries instead of splitting
K and V across warps that then exchange partial results through shared memory; its paper
measures it at about twice FlashAttention 1's speed. So the kernel is a setting of the
run (``Settings.attention``, ``--attention``), and ``flash1`` is its rate relative to
FlashAttention-2's: fitted where runs of a first-generation kernel are fitted, else the
paper's one half (Note [the prior]).

Note [what compilation saves]
Eager PyTorch runs each elementwise operation as its own kernel: a Llama-style block's
RMSNorms upcast, square, average, scale, cast back and weight in separate kernels, each
reading and writing its tensor and each launched from the host. torch.compile's Inductor
fuses such chains into one kernel per chain; the matrix multiplies (cuBLAS) and flash
attention (SDPA) stay the kernels they were. So a compiled run (``Settings.compile``:
"blocks", each block compiled as torchtitan does; "model", the whole model as KempnerForge
and fms-fsdp do, which also fuses the final norm and the launches of the units outside the
blocks) keeps its matrix-multiply, attention and loss time (the loss is computed outside
the compiled module in every published compiled run) and saves ``compile_saving`` of its
elementwise passes and of its launches, in forward, backward and recomputation alike. One
constant for both, because both count eager kernels: each fused-away kernel is one pass
over memory and one launch fewer. Its prior, by the same count as ``elementwise``'s (Note
[the prior]): fused, a block forward reads and writes each tensor once per chain, the first
RMSNorm (2d), rotary embedding on q and k (4d), the residual add with the second RMSNorm
(4d), SwiGLU (read 2f, write f) and the last residual add (3d): 13d + 3f against the eager
54d + 5f, with f = 3.5d 23.5d against 71.5d, so two thirds saved: 0.67. (The sources
that publish a run both ways report whole steps 16-28% faster compiled, torchtitan 16% and
fms-fsdp 19-28%; those figures fold in how much of each step is elementwise, which this
model prices by itself, and they are runs the constant is fitted to, so not its prior.)
Fitted where three or more compiled or hand-fused runs are fitted (Note [the prior]); its
memory effect (compiled runs hold fewer activations) is not modelled.

Hand-written fused kernels do in an eager run what Inductor does in a compiled one: a run
whose blocks call flash-attn's fused RMSNorm and rotary embedding and xformers' (or Liger's)
SwiGLU (``Settings.kernels``: "fused"; TinyLlama's lit-gpt code, docs/projection.md) reads
and writes each tensor once per chain, the count the prior above makes, and launches one
kernel where eager PyTorch launches several. So its blocks are priced as compiled blocks,
with the same constant (a run both compiled and hand-fused saves it once); the head and
embedding stay eager unless the whole model is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .shapes import ModelShape

BF16 = 2


@dataclass(frozen=True)
class KernelConstants:
    """The compute model's fitted constants (Note [the compute model])."""

    matmul: dict[str, float]        # per architecture: fraction of peak of a large GEMM
    attention: dict[str, float]     # per architecture: fraction of peak of flash attention
    # bf16 passes over a token's d + f activations per block forward, per kind of block
    elementwise: dict[str, float]
    loss_bytes: float               # bytes per token and vocabulary entry, whole step
    unit_overhead: float            # seconds per unit per forward (twice per backward)
    # a first-generation flash attention kernel's rate over a second-generation one's
    # (Note [attention by kernel, not by sequence length])
    flash1: float = 0.5
    # the share of a block's eager elementwise time and launches that torch.compile's fused
    # kernels save (Note [what compilation saves])
    compile_saving: float = 0.67
    # achieved fraction of the datasheet memory bandwidth: assumed, not fitted (the fit
    # cannot tell it from elementwise: both scale bytes per token over bandwidth)
    memory: float = 0.9

    def as_vector(self) -> list[float]:
        """The fitted constants, in order (``memory`` is not one)."""
        return [*self.matmul.values(), *self.attention.values(), *self.elementwise.values(),
                self.loss_bytes, self.unit_overhead, self.flash1, self.compile_saving]

    def from_vector(self, values: list[float]) -> "KernelConstants":
        values = list(values)
        take = lambda keys: dict(zip(keys, [values.pop(0) for _ in keys]))  # noqa: E731
        matmul, attention = take(list(self.matmul)), take(list(self.attention))
        elementwise = take(list(self.elementwise))
        rest = dict(zip(("loss_bytes", "unit_overhead", "flash1", "compile_saving"), values,
                        strict=True))
        return replace(self, matmul=matmul, attention=attention, elementwise=elementwise,
                       **rest)


@dataclass(frozen=True)
class PassSeconds:
    """One unit's compute in one micro-batch."""

    forward: float
    backward: float
    recompute: float  # what activation checkpointing adds to its backward
    # host overhead (launches, hooks) included in the three above: carried apart so that a
    # projection can say when it, not the device's work, sets the step
    overhead: float = 0.0


@dataclass(frozen=True)
class Rates:
    """What a device sustains for each kind of work."""

    peak: float          # FLOP/s
    bandwidth: float     # bytes/s
    matmul: float        # fraction of peak
    attention: float     # fraction of peak
    overhead: float      # seconds per unit per forward

    def gemm(self, m: float, k: float, n: float) -> float:
        return 2 * m * k * n / (self.peak * self.matmul) \
            + BF16 * (m * k + k * n + m * n) / self.bandwidth

    def gemm_backward(self, m: float, k: float, n: float) -> float:
        """The input gradient (m x n by n x k) and the weight gradient (k x m by m x n)."""
        return self.gemm(m, n, k) + self.gemm(k, m, n)

    def attention_seconds(self, flops: float) -> float:
        return flops / (self.peak * self.attention)


def block_kind(shape: ModelShape) -> str:
    """"llama" (RMSNorm, SwiGLU, rotary) or "gpt" (LayerNorm, GELU): Note [the compute model]."""
    return "llama" if shape.gated_mlp else "gpt"


def _block_gemms(shape: ModelShape, tokens: int) -> list[tuple[float, int, int]]:
    """(rows, in, out) of each matrix product of one block over ``tokens`` tokens. A
    mixture of experts: the router over every token, then each expert over its share,
    ``tokens * top_k / n_experts`` rows (routing balanced)."""
    d, f, q, kv = shape.d_model, shape.mlp_width, shape.q_width, shape.kv_width
    mlp = [(d, f), (d, f), (f, d)] if shape.gated_mlp else [(d, f), (f, d)]
    attention = [(tokens, d, q + 2 * kv), (tokens, q, d)]
    if not shape.n_experts:
        return attention + [(tokens, k, n) for k, n in mlp]
    share = tokens * shape.top_k / shape.n_experts
    return attention + [(tokens, d, shape.n_experts)] + [
        (share, k, n) for _ in range(shape.n_experts) for k, n in mlp]


def eager_share(c: KernelConstants, fused: bool) -> float:
    """What is left of the eager elementwise time and launches: all of it, or what fusion
    (torch.compile's or hand-written kernels') does not save (Note [what compilation
    saves])."""
    return 1.0 - c.compile_saving if fused else 1.0


def block_seconds(shape: ModelShape, tokens: int, seq: int, rates: Rates,
                  c: KernelConstants, kernel: str = "flash2",
                  fused: bool = False) -> tuple[PassSeconds, float, float]:
    """(forward/backward of one block, the recomputation of a fully checkpointed block,
    that of torchtitan's selective op policy), attention run by ``kernel``, the block's
    elementwise chains ``fused`` (by torch.compile or hand-written kernels) or eager."""
    gemms = _block_gemms(shape, tokens)
    mm_fwd = sum(rates.gemm(m, k, n) for m, k, n in gemms)
    mm_bwd = sum(rates.gemm_backward(m, k, n) for m, k, n in gemms)
    attn_fwd = rates.attention_seconds(2 * tokens * seq * shape.q_width) \
        / (c.flash1 if kernel == "flash1" else 1.0)
    kind, left = block_kind(shape), eager_share(c, fused)
    elem_fwd = tokens * BF16 * c.elementwise[kind] * left \
        * (shape.d_model + shape.mlps_per_token * shape.mlp_width) \
        / rates.bandwidth
    launch = rates.overhead * left
    forward = mm_fwd + attn_fwd + elem_fwd + launch
    backward = mm_bwd + 2.5 * attn_fwd + 2 * elem_fwd + 2 * launch
    return PassSeconds(forward, backward, 0.0, 3 * launch), forward, \
        mm_fwd / 2 + elem_fwd


def head_seconds(shape: ModelShape, tokens: int, rates: Rates, c: KernelConstants,
                 compiled: bool = False) -> PassSeconds:
    """The output projection and the loss over the vocabulary, with the final norm (a
    quarter of a block's elementwise passes, over d only); ``compiled``: the norm and the
    launches fused (the loss is outside the compiled model, as the trainers run it)."""
    d, v = shape.d_model, shape.vocab_size
    left = eager_share(c, compiled)
    loss = tokens * v * c.loss_bytes / rates.bandwidth
    norm = tokens * BF16 * c.elementwise[block_kind(shape)] / 4 * d * left / rates.bandwidth
    launch = rates.overhead * left
    return PassSeconds(rates.gemm(tokens, d, v) + loss / 2 + norm + launch,
                       rates.gemm_backward(tokens, d, v) + loss / 2 + 2 * norm
                       + 2 * launch, 0.0, 3 * launch)


def embedding_seconds(shape: ModelShape, tokens: int, rates: Rates,
                      launch: float | None = None) -> PassSeconds:
    """A gather forward; backward, its gradient rows summed into a zeroed table;
    ``launch``: its launches and hooks per forward (``rates.overhead`` eager)."""
    launch = rates.overhead if launch is None else launch
    table = shape.embedding_params * 4
    rows = tokens * shape.d_model * BF16
    return PassSeconds(rows / rates.bandwidth + launch,
                       (table + 2 * rows) / rates.bandwidth + 2 * launch, 0.0, 3 * launch)


# Note [the prior]: where every fit starts, and what a constant the fitted runs cannot pin keeps
PRIOR = KernelConstants(matmul={"ampere": 0.80, "hopper": 0.70},
                        attention={"ampere": 0.50, "hopper": 0.35},
                        elementwise={"gpt": 3.6, "llama": 16.0}, loss_bytes=36.0,
                        unit_overhead=0.5e-3)

# Fitted by ``projection.fit.fit_constants`` on the fit half of published_runs.csv
# (docs/projection.md); tests/projection/test_fit.py checks that no constant moved alone lowers
# the fit half's error, i.e. that these are the fit's minimum.
FITTED = KernelConstants(matmul={"ampere": 0.7818, "hopper": 0.6513},
                         attention={"ampere": 0.4083, "hopper": 0.2437},
                         elementwise={"gpt": 4.852, "llama": 24.19}, loss_bytes=31.77,
                         unit_overhead=0.5e-3, flash1=0.7607, compile_saving=0.6614)


def rates_for(peak: float, bandwidth: float, arch: str, c: KernelConstants = FITTED) -> Rates:
    """What a device of architecture ``arch`` sustains."""
    return Rates(peak, bandwidth * c.memory,
                 c.matmul[arch], c.attention[arch], c.unit_overhead)
