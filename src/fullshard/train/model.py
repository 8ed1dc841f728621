"""What a run trains and how it is sharded: the model (not yet sharded), how to get its
logits, and the data; the ``fully_shard`` calls; rank 0's initial weights, sent to the
other ranks after sharding.

Hugging Face causal LMs from a local folder (``--model hf:PATH``), no hub access.

Every rank builds the model from its config with the parameters on the meta device (in
fp32: the sharded parameters and the optimizer work in fp32; ``parallel.precision``
picks the compute dtype); the decoder layers named by the model's ``_no_split_modules``
become units, and each rank then reads its own shards from the folder's safetensors
files (``fullshard.checkpoint.load_hf``, Note [streaming safetensors into shards]). A
folder without safetensors files (``pytorch_model.bin``) is loaded whole by rank 0 and
sent to the others, as the GPT presets are. The folder's tokenizer is used when it has
one; see ``data.py`` for the fallback.

From ``[parallel]`` to ``fully_shard`` calls: the mesh, resharding, dtypes, recomputation,
expert parallelism (Note [expert parallelism in the trainer]).

Strategies map to fully_shard arguments as FSDP1's ``ShardingStrategy`` does:

=============  ========================================  =====================
strategy       mesh                                      reshard_after_forward
=============  ========================================  =====================
full_shard     1-D, all ranks                            True
shard_grad_op  1-D, all ranks                            False
zero1          1-D, all ranks                            False, and the gathered
                                                         storage kept across steps
hybrid_shard   2-D (replicas, world / replicas)          True
no_shard       2-D (world, 1): shard groups of one rank  (nothing to gather)
=============  ========================================  =====================

Note [ZeRO-1 is ZeRO-2 keeping the gathered storage]
ZeRO-1 replicates the parameters and shards the optimizer states: gradients are
reduce-scattered, each rank steps its shard, and the parameters are gathered again
after the step. fullshard runs it as shard_grad_op (parameters gathered once per step,
kept from forward to backward, gradients reduce-scattered per unit) whose gathered
storage stays allocated across steps (``set_keep_unsharded_storage(True)``): the
replicated parameters never leave the device and keep their addresses, and the next
forward's all-gather writes the stepped shards straight into them. Gradients are
sharded as soon as a unit's backward is done, as in ZeRO-2 (DeepSpeed's stage 1 keeps
them whole until the reduction; sharding them early costs no extra communication), so
zero1's memory is shard_grad_op's plus the gathered parameters during the optimizer
step and between steps; its traffic is shard_grad_op's. What it is for: parameters at
fixed addresses (CUDA graphs, compiled code that captures them) and no allocation per
step, with the optimizer states still sharded.

On a (replicate, shard) mesh fullshard shards within the shard dimension and
all-reduces gradients across the replicate one, so shard groups of size one are plain
data parallelism: every rank holds every parameter and gradients are averaged.

Note [expert parallelism in the trainer]
``--parallel.ep N`` lays the ranks out as torchtitan does: a (world / N, N) mesh whose
``ep`` rows split each block's experts N ways (``split_experts``: DTensors ``Shard(0)``)
and whose ``efsdp`` columns hold the same experts, over which the experts' unit shards.
Every other parameter shards over all ranks (the mesh flattened). A rank's tokens go to
their experts' ranks and back by all-to-all (``exchange_rows``), so an expert's gradient
sums the tokens of its ``ep`` row, and its reduce-scatter sums its ``efsdp`` column: all
ranks' tokens, divided by the world size (``set_gradient_divide_factor``) as the dense
gradients are. The experts' stacked weights always get a gradient (zero for an expert
no row went to, even when none of a rank's experts got one), as they do in one process.
Checkpoints hold the experts' whole tensors, so a run resumes at another N. The memory
estimate (``estimate(..., ep=N)``) makes each block's experts a unit of their own
holding 1/N of them, sharded over world / N ranks.

Rank 0's initial weights (GPT presets, and Hugging Face folders without safetensors): only
rank 0 builds (or loads) the full model on the CPU; the others build it on the
meta device, so a node needs host memory for one full copy instead of one per rank.
After ``fully_shard`` every rank receives its shards of rank 0's state dict, one tensor
at a time, and then the buffers a state dict leaves out (non-persistent ones such as
rotary-embedding frequencies), which the other ranks still hold on the meta device.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..activation_checkpointing import apply_activation_checkpointing
from ..api import fully_shard
from ..checkpoint import StateDictOptions, load_hf, parameters_on_meta, set_model_state_dict
from ..checkpoint.hf_load import tied_stored_apart
from ..fsdp_module import FSDPModule
from ..gpt import GPT, GPTConfig, GroupedExperts, MoE, split_experts
from ..offload.fraction import disk_path_and_fraction, offloaded_blocks, parse_fraction
from ..policies import (CPUOffloadPolicy, DiskOffloadPolicy, MixedPrecisionPolicy,
                        OffloadPolicy)
from ..wrap import ModuleWrapPolicy, apply_wrap_policy, auto_wrap, repeated_block_classes
from .config.schema import ConfigError, ParallelConfig, TrainConfig, get_preset
from .data import ByteTokenizer, CharTokenizer, Tokenizer, read_documents, split, tokenize
from .lora import add_lora
from .config.packages import import_optional


# -- what a run trains -----------------------------------------------------------------

@dataclass
class Workload:
    model: nn.Module
    logits: Callable[[torch.Tensor], torch.Tensor]
    """ids (batch x time) -> logits (batch x time x vocab), through the model's forward."""
    tokenizer: Tokenizer
    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    context: int
    """Longest input the model is given (the sample's sliding window)."""
    initial_state: dict | None
    """Rank 0's initial weights (a full state dict; empty on other ranks, whose model is
    on the meta device), to broadcast into the sharded model (receive_initial_weights);
    None when every rank built the whole model (LoRA) or reads its shards itself."""
    weights_folder: str | None = None
    """The Hugging Face folder each rank reads its shards from after sharding (load_hf),
    when the model's parameters are on the meta device on every rank."""


def build_workload(cfg: TrainConfig, rank: int, world: int = 1) -> Workload:
    """Load the data and the model. A Hugging Face model with safetensors weights is built
    with its parameters on the meta device on every rank, which read their shards after
    sharding (load_initial_weights). Otherwise rank 0 loads the Hugging Face model or
    builds the GPT (on the CPU, from ``cfg.seed``), the other ranks build it on the meta
    device and receive rank 0's weights after sharding. With LoRA adapters every rank
    builds the whole model itself (train/lora.py) and nothing is received."""
    documents = read_documents(cfg.data)
    streamed = cfg.is_hf and not cfg.lora.rank and has_safetensors(cfg.hf_path)
    if cfg.is_hf and cfg.lora.rank:
        model = load_hf_model(cfg.hf_path)
        torch.manual_seed(cfg.seed)  # the same adapters on every rank
        model = add_lora(model, cfg.lora, world)
        tokenizer = load_hf_tokenizer(cfg.hf_path, hf_vocab_size(model))
        logits = functools.partial(hf_logits, model)
    elif cfg.is_hf:
        model = load_hf_model(cfg.hf_path, on_meta=streamed or rank != 0)
        tokenizer = load_hf_tokenizer(cfg.hf_path, hf_vocab_size(model))
        logits = functools.partial(hf_logits, model)
    else:
        tokenizer = CharTokenizer(documents)
        if tokenizer.vocab_size > cfg.gpt.vocab_size:
            raise ConfigError(f"gpt.vocab_size: the data has {tokenizer.vocab_size} distinct "
                              f"characters, more than {cfg.gpt.vocab_size}; raise it to "
                              f"at least {tokenizer.vocab_size}")
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.gpt, "cpu" if rank == 0 else "meta")
        logits = model
    initial_state = None if cfg.lora.rank or streamed else \
        model.state_dict() if rank == 0 else {}
    train_tokens, val_tokens = split(tokenize(documents, tokenizer), cfg.batch.val_fraction)
    return Workload(model, logits, tokenizer, train_tokens, val_tokens, cfg.batch.seq_len,
                    initial_state, cfg.hf_path if streamed else None)


# -- the GPT a preset builds -----------------------------------------------------------

def build_model(shape: GPTConfig, device: str | torch.device = "cpu") -> GPT:
    """The GPT of ``shape`` on ``device``. On "meta" nothing is allocated (for sizing, or
    for ``to_empty`` then ``init_weights``); elsewhere the weights are initialized from
    torch's current RNG state."""
    with torch.device(device):
        return GPT(shape)


def preset_model(name: str, device: str | torch.device = "meta") -> GPT:
    """The model preset ``name`` trains, on ``device`` (default meta: for sizing)."""
    return build_model(get_preset(name).gpt, device)


# -- Hugging Face models ---------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _transformers():
    return import_optional("model")


def has_safetensors(path: str) -> bool:
    """Whether the folder holds its weights as safetensors files (which every rank can
    read its own shards from)."""
    return os.path.isdir(path) and any(n.endswith(".safetensors") for n in os.listdir(path))


def load_hf_model(path: str, on_meta: bool = False) -> nn.Module:
    """The causal LM saved in ``path`` (``save_pretrained`` layout), in fp32, train mode;
    with ``on_meta`` only its structure: parameters on the meta device (no weights read),
    buffers real (the ones no checkpoint holds, such as rotary frequencies)."""
    transformers = _transformers()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model: {path!r} is not a Hugging Face model folder (no "
                          "config.json); hf:PATH takes a local folder, not a hub name")
    transformers.utils.logging.disable_progress_bar()  # one bar per rank is noise
    if on_meta:
        model = _hf_on_meta(transformers, path)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.config.use_cache = False  # training: no key/value cache to build
    return model.float().train()


def _hf_on_meta(transformers, path: str) -> nn.Module:
    """The model of ``path``'s config, parameters on the meta device, untied where the
    files store a tied tensor with values of its own (as from_pretrained unties it)."""
    config = transformers.AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    apart = tied_stored_apart(model, path) if has_safetensors(path) else []
    if not apart:
        return model
    warnings.warn(f"fullshard: {path} holds {apart[0][0]} with values other than "
                  f"{apart[0][1]}, which its config ties it to; training them untied, with "
                  "the stored values, as transformers' from_pretrained does. Set "
                  "tie_word_embeddings=False in config.json to silence this warning.",
                  stacklevel=3)
    config.tie_word_embeddings = False
    with parameters_on_meta():
        return transformers.AutoModelForCausalLM.from_config(config)


def hf_vocab_size(model: nn.Module) -> int:
    return model.get_input_embeddings().num_embeddings


class HFTokenizer:
    """The folder's tokenizer, adding no special tokens (documents are joined by EOS)."""

    name = "the model's tokenizer"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        self.separator = [] if eos is None else [eos]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def load_hf_tokenizer(path: str, model_vocab_size: int) -> Tokenizer:
    """The folder's tokenizer if it has one, else UTF-8 bytes clipped to the vocabulary."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return ByteTokenizer(model_vocab_size)
    tokenizer = HFTokenizer(_transformers().AutoTokenizer.from_pretrained(path))
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"model: the tokenizer in {path} has {tokenizer.vocab_size} ids, "
                          f"more than the model's {model_vocab_size} embeddings")
    return tokenizer


def hf_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


# What ``fullshard ckpt export --hf`` copies beside the weights (train/export/hf.py).
EXPORT_DIR = "hf"


def save_for_export(cfg: TrainConfig, workload: Workload, out: str) -> None:
    """Rank 0, Hugging Face models: the source folder's config (and generation config)
    and the tokenizer the run uses into ``OUT/hf``, so that an export needs neither the
    source folder nor hub access later. A GPT's Hugging Face config is derived at export."""
    if not cfg.is_hf:
        return
    transformers = _transformers()
    target = os.path.join(out, EXPORT_DIR)
    os.makedirs(target, exist_ok=True)
    # Read again rather than taken from the model: training changed use_cache.
    transformers.AutoConfig.from_pretrained(cfg.hf_path).save_pretrained(target)
    if os.path.isfile(os.path.join(cfg.hf_path, "generation_config.json")):
        transformers.GenerationConfig.from_pretrained(cfg.hf_path).save_pretrained(target)
    if isinstance(workload.tokenizer, HFTokenizer):
        workload.tokenizer.tokenizer.save_pretrained(target)


# -- sharding --------------------------------------------------------------------------

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Meshes(NamedTuple):
    dense: DeviceMesh
    """What every unit shards over (all but the experts' under expert parallelism)."""
    experts: DeviceMesh | None
    """(efsdp, ep) under ``parallel.ep`` > 1: each expert's weights on the ``ep`` ranks
    that split the experts, sharded over the ``efsdp`` ranks holding the same ones."""


def build_mesh(parallel: ParallelConfig, device_type: str, world: int,
               ranks_per_node: int) -> Meshes:
    """The device meshes ``parallel.strategy`` and ``parallel.ep`` shard over."""
    if parallel.ep > 1:  # Note [expert parallelism in the trainer]
        if world % parallel.ep:
            raise ConfigError(f"parallel.ep: {parallel.ep} does not divide the world size "
                              f"{world}; give a divisor of both it and gpt.n_experts")
        joint = init_device_mesh(device_type, (world // parallel.ep, parallel.ep),
                                 mesh_dim_names=("efsdp", "ep"))
        return Meshes(joint._flatten("shard"), joint)
    if parallel.strategy in ("full_shard", "shard_grad_op", "zero1"):
        return Meshes(init_device_mesh(device_type, (world,), mesh_dim_names=("shard",)), None)
    if parallel.strategy == "no_shard":
        replicas = world
    else:
        replicas = parallel.replicas or max(1, world // ranks_per_node)
        if world % replicas:
            raise ConfigError(f"parallel.replicas: {replicas} does not divide the world size "
                              f"{world}; give a divisor of it, or 0 for one replica per node")
        if replicas == world and parallel.quantize != "none":
            raise ConfigError(f"parallel.quantize: {parallel.quantize} quantizes all-gathers and "
                              f"reduce-scatters, which hybrid_shard with parallel.replicas "
                              f"{replicas} over {world} ranks (shard groups of one rank) does "
                              "not issue; give fewer replicas or parallel.quantize none")
    return Meshes(init_device_mesh(device_type, (replicas, world // replicas),
                                   mesh_dim_names=("replicate", "shard")), None)


def reshard_after_forward(parallel: ParallelConfig) -> bool | int:
    """The explicit setting, else the strategy's (shard_grad_op and zero1 keep parameters)."""
    if parallel.reshard_after_forward is not None:
        return parallel.reshard_after_forward
    return parallel.strategy not in ("shard_grad_op", "zero1")


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """Gather and compute in the chosen dtype, reduce gradients in fp32 (fp32 shards)."""
    dtype = COMPUTE_DTYPES[precision]
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_model(model: nn.Module, parallel: ParallelConfig, meshes: Meshes) -> nn.Module:
    """Checkpoint activations per block if asked, then make every repeated block (GPT
    ``Block``s, a Hugging Face model's ``_no_split_modules``) a unit, then the root; under
    expert parallelism each block's experts first, on their own mesh."""
    blocks = tuple(repeated_block_classes(model))
    if parallel.activation_checkpointing:
        apply_activation_checkpointing(model, lambda m: isinstance(m, blocks))
    if parallel.compile:
        compile_blocks(model, blocks)
    offload_of = unit_offload(model, parallel)
    how = dict(reshard_after_forward=reshard_after_forward(parallel),
               mp_policy=mixed_precision(parallel.precision))
    if meshes.experts is not None:
        shard_experts(model, meshes.experts, offload_of, **how)
    sharded = auto_wrap(model, lambda m: {"offload_policy": offload_of(m)},
                        mesh=meshes.dense, **how)
    if parallel.strategy == "zero1":  # Note [ZeRO-1 is ZeRO-2 keeping the gathered storage]
        sharded.set_keep_unsharded_storage(True)
    if parallel.quantize != "none":  # Note [quantized communication]
        words = parallel.quantize.split(",")
        for unit in sharded.modules():
            # experts split over every rank (ep = world) hold theirs whole: nothing to quantize
            if isinstance(unit, FSDPModule) and not (
                    isinstance(unit, GroupedExperts) and meshes.experts["efsdp"].size() == 1):
                unit.set_quantized_communication(weights="weights" in words,
                                                 grads="grads" in words, recurse=False)
    if parallel.symm_mem:  # Note [staging buffers from the process group]
        _use_symmetric_memory(sharded, meshes.dense.device_type)
    return sharded


def _use_symmetric_memory(sharded: nn.Module, device_type: str) -> None:
    """``--parallel.symm_mem``: every unit's all-gathers into symmetric memory, or the
    flag named where it cannot work (every rank checks alone, before any collective)."""
    if device_type != "cuda":
        raise ConfigError(f"parallel.symm_mem: true cannot work here (this run computes on "
                          f"{device_type}); it needs CUDA devices, NCCL and a torch built "
                          "with symmetric memory. Leave it false.")
    for unit in sharded.modules():
        if not isinstance(unit, FSDPModule):
            continue
        try:
            unit.set_symm_mem_for_comm()
        except (RuntimeError, ValueError) as err:
            why = str(err).splitlines()[0]
            raise ConfigError(f"parallel.symm_mem: true cannot work here ({why}); it needs "
                              "CUDA devices, NCCL and a torch built with symmetric memory. "
                              "Leave it false.") from None


def unit_offload(model: nn.Module, parallel: ParallelConfig
                 ) -> Callable[[nn.Module], OffloadPolicy | None]:
    """The offload policy of each module the trainer makes a unit (``None``: on the
    device). ``cpu:FRACTION`` and ``disk:PATH:FRACTION`` offload the last blocks and what
    is inside them (their experts), Note [which blocks a fraction offloads] in
    offload/fraction.py."""
    offload = parallel.offload
    if offload == "none":
        return lambda _m: None
    policy: OffloadPolicy
    if offload.startswith("disk:"):  # Note [optimizer states on disk]
        path, fraction = disk_path_and_fraction(offload[len("disk:"):])
        policy = DiskOffloadPolicy(path=path, params=parallel.offload_params,
                                   params_on_device=parallel.params_on_device)
    else:
        policy = CPUOffloadPolicy(params_on_device=parallel.params_on_device)
        fraction = parse_fraction(offload[4:]) if offload.startswith("cpu:") else 1.0
    if fraction == 1:
        return lambda _m: policy
    classes = repeated_block_classes(model)
    blocks = apply_wrap_policy(model, ModuleWrapPolicy(classes), lambda _m: None)
    inside = {id(m) for b in offloaded_blocks(blocks, fraction) for m in b.modules()}
    return lambda m: policy if id(m) in inside else None


def shard_experts(model: nn.Module, joint: DeviceMesh,
                  offload_of: Callable[[nn.Module], OffloadPolicy | None], **how) -> None:
    """Split every MoE block's experts over ``joint["ep"]`` and shard each block's part
    over ``joint["efsdp"]``: Note [expert parallelism in the trainer]."""
    split_experts(model, joint["ep"])
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        unit = fully_shard(moe.experts, mesh=joint["efsdp"],
                           offload_policy=offload_of(moe.experts), **how)
        unit.set_gradient_divide_factor(joint.size())


def compile_blocks(model: nn.Module, blocks: tuple[type, ...] | None = None) -> None:
    """Replace each block (of ``blocks``, default the repeated ones; or its checkpoint
    wrapper) by ``torch.compile`` of it, in place. Sharding afterwards makes the block
    inside a unit: each compiled graph is one block's forward between fullshard's hooks,
    as torchtitan compiles."""
    blocks = blocks or tuple(repeated_block_classes(model))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            inner = getattr(child, "_checkpoint_wrapped_module", child)
            if isinstance(inner, blocks):
                parent.register_module(name, torch.compile(child))


# -- rank 0's initial weights ----------------------------------------------------------

def load_initial_weights(model: nn.Module, workload: Workload, device: torch.device) -> None:
    """The sharded model's first weights: each rank's shards read from the Hugging Face
    folder, or rank 0's state received (nothing when every rank built the whole model)."""
    if workload.weights_folder is not None:
        load_hf(model, workload.weights_folder)  # Note [streaming safetensors into shards]
    elif workload.initial_state is not None:
        receive_initial_weights(model, workload.initial_state, device)
    workload.initial_state = {}


def receive_initial_weights(model: nn.Module, rank0_state: dict, device: torch.device) -> None:
    """Load rank 0's full ``rank0_state`` (empty on other ranks) into the sharded ``model``."""
    set_model_state_dict(model, rank0_state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    _broadcast_left_out_buffers(model, set(rank0_state) if dist.get_rank() == 0 else None,
                                device)


def _broadcast_left_out_buffers(model: nn.Module, saved: set[str] | None,
                                device: torch.device) -> None:
    """Send every buffer missing from rank 0's state dict, in ``named_buffers`` order (the
    same on every rank: the same architecture)."""
    names = [saved] if saved is not None else [None]
    dist.broadcast_object_list(names, src=0)  # which buffers the state dict carried
    carried = names[0]
    with torch.no_grad():
        for name, buf in list(model.named_buffers()):
            if name in carried:
                continue
            owner_path, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_path)
            if buf.is_meta:
                buf = torch.empty_like(buf, device=device)
                owner._buffers[attr] = buf
            dist.broadcast(buf, src=0)
