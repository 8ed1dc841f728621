"""Checkpoints torch's DCP wrote: where a model's tensors (and its optimizer's state) are
among their keys, which the saving program chose.

``dcp.save({"model": model_sd, "optim": optim_sd})`` (torch's recipe, and fullshard's own
layout) keeps them under ``model.`` and ``optim.``; ``dcp.save(model.state_dict())`` at
the top level; an ``AppState`` wrapper under ``app.model.`` and ``app.optim.``. The model's
prefix is the one under which every key of the model's state dict is found.
"""

from __future__ import annotations

from typing import Any

import torch.distributed.checkpoint as dcp
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


def stateless(metadata: Metadata, prefix: str, state: dict[str, dict]) -> list[str]:
    """The parameters of an optimizer's ``state`` (by name, as torch's
    ``get_optimizer_state_dict`` gives it) of which the checkpoint holds no state at all
    under ``prefix``: the saved optimizer had not stepped them yet."""
    saved = metadata.state_dict_metadata
    return [name for name, values in state.items()
            if values and not any(f"{prefix}state.{name}.{key}" in saved for key in values)]


def saved_group_keys(metadata: Metadata, prefix: str) -> list[set[str]]:
    """The names in each param group of the optimizer saved under ``prefix`` (its
    hyperparameters and ``params``): another optimizer's differ (SGD's ``momentum``,
    AdamW's ``betas``)."""
    groups: dict[int, set[str]] = {}
    start = prefix + "param_groups."
    for key in metadata.state_dict_metadata:
        if key.startswith(start):
            index, _, name = key[len(start):].partition(".")
            if index.isdigit():
                groups.setdefault(int(index), set()).add(name.split(".")[0])
    return [groups[i] for i in sorted(groups)]


def saved_parameter_names(path: str, metadata: Metadata, prefix: str) -> set[str]:
    """The parameter names listed in the param_groups of the optimizer saved under
    ``prefix``: one small read of this rank's own."""
    lists: dict[str, Any] = {key: [] for key in metadata.state_dict_metadata
                             if key.startswith(prefix + "param_groups.") and key.endswith(".params")}
    if lists:
        dcp.load(lists, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return {name for names in lists.values() for name in names}
