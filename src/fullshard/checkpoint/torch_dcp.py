"""Checkpoints torch's DCP wrote: where a model's tensors (and its optimizer's state) are
among their keys, which the saving program chose.

``dcp.save({"model": model_sd, "optim": optim_sd})`` (torch's recipe, and fullshard's own
layout) keeps them under ``model.`` and ``optim.``; ``dcp.save(model.state_dict())`` at
the top level; an ``AppState`` wrapper under ``app.model.`` and ``app.optim.``. The model's
prefix is the one under which every key of the model's state dict is found.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

MODEL = "model."
OPTIM = "optim."


def model_prefix(metadata: Metadata, model_keys: list[str]) -> str:
    """The prefix under which ``metadata`` holds the most of ``model_keys`` (all of them
    for a checkpoint of this model); ``model.`` when it holds none."""
    saved = metadata.state_dict_metadata
    if not model_keys:
        return MODEL
    probe = model_keys[0]
    candidates = {key[:-len(probe)] for key in saved if key.endswith(probe)}
    candidates = {p for p in candidates if p == "" or p.endswith(".")}
    if not candidates:
        return MODEL
    return max(sorted(candidates), key=lambda p: sum(p + k in saved for k in model_keys))


def optimizer_prefix(prefix: str) -> str | None:
    """Where the optimizer's state lies beside a model under ``prefix`` (None: nowhere
    fullshard would look)."""
    return prefix[:-len(MODEL)] + OPTIM if prefix.endswith(MODEL) else None


def has_keys_under(metadata: Metadata, prefix: str | None) -> bool:
    return prefix is not None and any(k.startswith(prefix) for k in metadata.state_dict_metadata)


def tensors(metadata: Metadata, prefix: str) -> dict[str, dict]:
    """Each tensor under ``prefix`` (the prefix removed) -> its shape and dtype, as a
    fullshard manifest describes them."""
    return {key[len(prefix):]: {"shape": list(m.size),
                                "dtype": str(m.properties.dtype).removeprefix("torch.")}
            for key, m in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)}


def nest(prefix: str, value: dict, into: dict | None = None) -> dict:
    """``value`` placed in a nested dict so that DCP's flattened keys are ``prefix`` +
    its keys (``a.model.`` -> ``{"a": {"model": value}}``)."""
    tree: dict[str, Any] = {} if into is None else into
    node = tree
    parts = prefix.split(".")[:-1]
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if parts:
        node[parts[-1]] = value
    else:
        node.update(value)
    return tree
