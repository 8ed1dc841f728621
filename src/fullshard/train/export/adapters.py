"""``fullshard ckpt export CKPT OUT --adapters``: the LoRA adapters of a ``fullshard
train --lora.rank R`` run as the folder ``peft.PeftModel.from_pretrained(base, OUT)``
loads: ``adapter_model.safetensors`` (peft's names: the adapter's name left out) and
``adapter_config.json`` (rank, alpha, the adapted layers, the base model's folder).
The base weights are not written: they are the folder the run trained from (an NF4 base
is that folder's weights quantized)."""

from __future__ import annotations

import os
import sys

from ...checkpoint.export import SINGLE_FILE, ExportedTensor, export_sharded, model_tensors
from ...checkpoint.verify import open_checkpoint
from ..checkpoints import run_checkpoint
from ..config.schema import ConfigError
from ..config.packages import import_optional

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # the name peft gives the adapters it adds


def export_adapters(path: str, out_dir: str) -> list[str]:
    """Write the adapters of the checkpoint ``path`` to ``out_dir``; the files written."""
    checkpoint, run, cfg = run_checkpoint(path, "--adapters")
    if not cfg.lora.rank:
        raise ConfigError(f"--adapters: the run {run} trained without LoRA adapters "
                          "(lora.rank = 0); export its whole model with --hf")
    peft = import_optional("--adapters")
    opened = open_checkpoint(checkpoint, collective=False)  # before any file is read
    marker = f".{ADAPTER_NAME}."
    entries = [ExportedTensor(name.replace(marker, "."), name)
               for name in model_tensors(checkpoint)
               if (".lora_A." in name or ".lora_B." in name) and marker in name]
    layers = sorted({e.name.split(".lora_")[0].rsplit(".", 1)[-1] for e in entries})
    os.makedirs(out_dir, exist_ok=True)
    written = export_sharded(opened, out_dir, entries, sys.maxsize)
    adapters = os.path.join(out_dir, ADAPTER_FILE)
    os.replace(os.path.join(out_dir, SINGLE_FILE), adapters)
    peft.LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                    target_modules=layers, task_type="CAUSAL_LM",
                    base_model_name_or_path=cfg.hf_path).save_pretrained(out_dir)
    return [adapters if w.endswith(SINGLE_FILE) else w for w in written] + [
        os.path.join(out_dir, "adapter_config.json")]
