"""``fullshard ckpt export CKPT OUT --hf``: a checkpoint of ``fullshard train`` as a
Hugging Face folder that ``AutoModelForCausalLM.from_pretrained(OUT)`` loads.

The folder holds ``config.json`` (and ``generation_config.json``), the tokenizer when the
run had one, and the weights as ``model.safetensors`` or, above ``--max-shard-size``,
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``. The weights are
streamed from the checkpoint one tensor at a time (``checkpoint/export.py``): the export
never holds the model in memory.

What the checkpoint holds comes from its run: OUT/config.toml beside OUT/checkpoints.

- ``--model hf:DIR`` runs: the config and tokenizer the trainer copied into OUT/hf when
  the run started (or DIR itself, for runs from before that copy). The tensor names are
  the model's own; of tied weights (GPT-2's ``lm_head``) only the first name is written,
  as ``save_pretrained`` does.
- The built-in GPT is GPT-2's architecture exactly (pre-LayerNorm blocks with eps 1e-5,
  exact GELU, fused q/k/v in that order, learned positions, biases everywhere but the
  output projection), so it is written as a ``GPT2LMHeadModel``: renamed, and the four
  linear weights of each block transposed (GPT-2 stores them as ``Conv1D``, input by
  output), with ``activation_function="gelu"`` and no dropout. Its character vocabulary
  has no Hugging Face tokenizer, so none is written: ids are the sorted distinct characters
  of the training text, as ``fullshard train`` printed its sample with.
"""

from __future__ import annotations

import os
import re

import torch

from ...checkpoint.export import ExportedTensor, export_sharded, model_tensors
from ...checkpoint.layout import CheckpointError
from ...checkpoint.verify import open_checkpoint
from ...gpt import GPTConfig
from ..checkpoints import RUN_CONFIG, run_checkpoint
from ..config.schema import ConfigError, TrainConfig
from ..model import EXPORT_DIR, TOKENIZER_FILES
from ..config.packages import import_optional

DEFAULT_MAX_SHARD_SIZE = "5GB"  # save_pretrained's default in transformers 4
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit (KB, MB, GB: powers of 1000, as
    Hugging Face counts; KiB, MiB, GiB: powers of 1024)."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise ConfigError(f"--max-shard-size: expected a positive size such as 5GB, 500MB "
                          f"or 2GiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def export_hf(path: str, out_dir: str, max_shard_bytes: int) -> list[str]:
    """Write the Hugging Face folder ``out_dir`` for the checkpoint ``path`` (see the
    module doc); returns the files written."""
    checkpoint, run, cfg = run_checkpoint(path, "--hf", "; export it without --hf")
    if os.path.isfile(out_dir):
        raise ConfigError(f"--hf: {out_dir} is a file; give a folder to write the model to")
    if cfg.lora.rank:
        raise ConfigError(f"--hf: the run {run} trained LoRA adapters over a frozen base "
                          "(lora.rank > 0); export the adapters with --adapters and load "
                          "them over the base with peft.PeftModel.from_pretrained")
    if not cfg.is_hf and cfg.gpt.n_experts:
        raise ConfigError(f"--hf: the run {run} trained a mixture of experts (gpt.n_experts "
                          f"{cfg.gpt.n_experts}), which the GPT-2 format --hf writes has no "
                          "place for; export its tensors without --hf")
    transformers = import_optional("--hf")
    opened = open_checkpoint(checkpoint, collective=False)  # before any file is read
    if cfg.is_hf:
        source = _hf_source(run, cfg)
        config = transformers.AutoConfig.from_pretrained(source)
        entries, tied = _hf_entries(transformers, config)
    else:
        source = None
        config = gpt2_config(transformers, cfg.gpt)
        entries = gpt2_entries(cfg.gpt)
        tied = {"lm_head.weight"} if cfg.gpt.tie_embeddings else set()
    _check_fits(checkpoint, entries, tied, run)
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    written = [os.path.join(out_dir, "config.json")]
    if source is not None:
        written += _copy_generation_config_and_tokenizer(transformers, source, out_dir)
    return written + export_sharded(opened, out_dir, entries, max_shard_bytes)


# -- Hugging Face models (--model hf:DIR) ----------------------------------------------

def _hf_source(run: str, cfg: TrainConfig) -> str:
    """Where the run's config and tokenizer are: OUT/hf, else the folder it trained from."""
    for folder in (os.path.join(run, EXPORT_DIR), cfg.hf_path):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise ConfigError(f"--hf: no config.json in {os.path.join(run, EXPORT_DIR)} nor in "
                      f"{cfg.hf_path} (the folder the run trained from); copy the model's "
                      f"config.json into {os.path.join(run, EXPORT_DIR)}")


def _hf_entries(transformers, config) -> tuple[list[ExportedTensor], set[str]]:
    """The model's state-dict names but tied duplicates, and those duplicates (read on
    the meta device)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    kept = dict(model.named_parameters())  # one name per group of tied parameters
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - kept.keys()
    return [ExportedTensor(name, name) for name in model.state_dict() if name not in tied], tied


def _copy_generation_config_and_tokenizer(transformers, source: str, out_dir: str
                                          ) -> list[str]:
    written = []
    if os.path.isfile(os.path.join(source, "generation_config.json")):
        transformers.GenerationConfig.from_pretrained(source).save_pretrained(out_dir)
        written.append(os.path.join(out_dir, "generation_config.json"))
    if any(os.path.isfile(os.path.join(source, name)) for name in TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
        written += [f for f in tokenizer.save_pretrained(out_dir) if os.path.isfile(f)]
    return written


# -- the built-in GPT as GPT-2 ---------------------------------------------------------

def gpt2_config(transformers, gpt: GPTConfig):
    """The ``GPT2Config`` whose ``GPT2LMHeadModel`` computes what ``GPT(gpt)`` does."""
    return transformers.GPT2Config(
        vocab_size=gpt.vocab_size, n_positions=gpt.seq_len, n_embd=gpt.d_model,
        n_layer=gpt.n_layers, n_head=gpt.n_heads, n_inner=gpt.mlp_ratio * gpt.d_model,
        activation_function="gelu", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=gpt.tie_embeddings,
        bos_token_id=None, eos_token_id=None, architectures=["GPT2LMHeadModel"])


def gpt2_entries(gpt: GPTConfig) -> list[ExportedTensor]:
    """GPT tensor -> GPT-2 name; the blocks' linear weights transposed (Conv1D layout)."""
    entries = [ExportedTensor("transformer.wte.weight", "tok_emb.weight"),
               ExportedTensor("transformer.wpe.weight", "pos_emb.weight")]
    linear = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc",
              "mlp.proj": "mlp.c_proj"}
    norms = {"ln1": "ln_1", "ln2": "ln_2"}
    for i in range(gpt.n_layers):
        for ours, theirs in (*linear.items(), *norms.items()):
            for kind in ("weight", "bias"):
                entries.append(ExportedTensor(f"transformer.h.{i}.{theirs}.{kind}",
                                              f"layers.{i}.{ours}.{kind}",
                                              transpose=ours in linear and kind == "weight"))
    entries += [ExportedTensor("transformer.ln_f.weight", "ln_f.weight"),
                ExportedTensor("transformer.ln_f.bias", "ln_f.bias")]
    if not gpt.tie_embeddings:
        entries.append(ExportedTensor("lm_head.weight", "lm_head.weight"))
    return entries


def _check_fits(checkpoint: str, entries: list[ExportedTensor], tied: set[str], run: str
                ) -> None:
    """Every tensor the export reads is in the checkpoint, and nothing else is (but the
    ``tied`` copies): else the run's config.toml does not describe it."""
    saved = set(model_tensors(checkpoint))
    wanted = {e.source for e in entries}
    missing, extra = sorted(wanted - saved), sorted(saved - wanted - tied)
    if missing or extra:
        names = ", ".join((missing or extra)[:3])
        what = "lacks" if missing else "has tensors the model does not:"
        raise CheckpointError(f"--hf: checkpoint {checkpoint} {what} {names}; it does not "
                              f"hold the model {os.path.join(run, RUN_CONFIG)} describes")
