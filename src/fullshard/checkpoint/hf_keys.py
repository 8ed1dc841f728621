"""Which checkpoint tensors make which of a model's state-dict entries, as transformers
decides it when it loads the model.

Note [the model's own conversion]
A Hugging Face checkpoint's keys are not always the model's names. transformers >= 5 keeps
a conversion mapping per architecture (``conversion_mapping.get_model_conversion_mapping``):
``WeightRenaming``s (Mixtral's ``block_sparse_moe.`` is the model's ``mlp.``) and
``WeightConverter``s, which build one tensor of the model from several of the checkpoint
(Mixtral's per-expert ``experts.N.w1.weight`` and ``w3`` are stacked and concatenated into
the fused ``experts.gate_up_proj``). Keys are renamed with transformers' own
``rename_source_key``, after sorting them as transformers does (the experts' order), and a
converter is deep-copied per target and run by its own ``convert``: the load follows the
model's conversion exactly, whatever architecture it is, and follows transformers when it
changes. A converted target is built whole (its sources read whole, one target at a
time); every other entry is read straight into the shard that owns it. Before
transformers 5 checkpoint keys are the model's names, up to its ``base_model_prefix``
(a ``LlamaModel``'s checkpoint loads into ``LlamaForCausalLM`` and back), and a model that
is not transformers' (fullshard's GPT, any module) matches its state dict's names exactly.
Converters are first run on meta tensors, so a converted tensor whose shape does not fit
is named before anything is read.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from ..api import original_class


@dataclass
class Direct:
    """A state-dict entry read as it is stored: checkpoint ``key`` into ``target``."""

    target: str
    key: str


@dataclass
class Converted:
    """State-dict entries one transformers ``WeightConverter`` builds from several
    checkpoint tensors: ``sources`` are (checkpoint key, the converter's source pattern)
    in transformers' order; ``layer`` names the group (its first target)."""

    layer: str
    converter: Any
    sources: list[tuple[str, str]] = field(default_factory=list)

    def run(self, model: nn.Module, read: Callable[[str], torch.Tensor]
            ) -> dict[str, torch.Tensor]:
        """The converted tensors by state-dict name, the sources read with ``read``."""
        converter = copy.deepcopy(self.converter)
        for key, pattern in self.sources:
            converter.add_tensor(self.layer, key, pattern, functools.partial(read, key))
        out = converter.convert(self.layer, model=model, config=getattr(model, "config", None))
        return {name: (value[0] if isinstance(value, list) else value)
                for name, value in out.items()}


@dataclass
class KeyPlan:
    """What the load reads: the direct entries, the converted groups, and the checkpoint
    keys no entry of the model takes (``unexpected``)."""

    direct: dict[str, Direct]
    converted: list[Converted]
    unexpected: list[str]


def plan_keys(model: nn.Module, targets: set[str], keys: list[str]) -> KeyPlan:
    """Map the checkpoint's ``keys`` onto the model's state-dict names ``targets`` (Note
    [the model's own conversion])."""
    machinery = _transformers_conversion()
    if machinery is None or not _is_transformers_model(model):
        return _plan_by_name(model, targets, keys)
    rename_source_key, natural_key, mapping_of, renaming_type, converter_type = machinery
    with _unsharded_classes(model):
        transforms = mapping_of(model)
    renamings = [t for t in transforms if isinstance(t, renaming_type)]
    converters = [t for t in transforms if isinstance(t, converter_type)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    present = dict.fromkeys(targets, True)
    direct: dict[str, Direct] = {}
    converted: dict[str, Converted] = {}
    unexpected: list[str] = []
    for key in sorted(keys, key=natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, present)
        if target not in present and key in present:  # transformers' own second try
            target, pattern = rename_source_key(key, [], [], prefix, present)
        if target not in present:
            unexpected.append(key)
        elif pattern is not None:
            group = converted.setdefault(target, Converted(target, by_pattern[pattern]))
            group.sources.append((key, pattern))
        elif target not in direct or key == target:  # a name of the target itself wins
            direct[target] = Direct(target, key)
    return KeyPlan(direct, list(converted.values()), unexpected)


def _plan_by_name(model: nn.Module, targets: set[str], keys: list[str]) -> KeyPlan:
    """Checkpoint keys are the model's names, up to a transformers model's
    ``base_model_prefix`` (transformers before version 5)."""
    prefix = getattr(model, "base_model_prefix", "") if _is_transformers_model(model) else ""
    direct: dict[str, Direct] = {}
    unexpected = []
    for key in sorted(keys):
        candidates = [key]
        if prefix:
            candidates += [key[len(prefix) + 1:]] if key.startswith(prefix + ".") \
                else [f"{prefix}.{key}"]
        target = next((c for c in candidates if c in targets), None)
        if target is None:
            unexpected.append(key)
        elif target not in direct or key == target:
            direct[target] = Direct(target, key)
    return KeyPlan(direct, [], unexpected)


def ignored_patterns(model: nn.Module, which: str) -> list[re.Pattern]:
    """The model's ``_keys_to_ignore_on_load_{which}`` (transformers' regexes of keys a
    checkpoint may lack, or may have in excess)."""
    patterns = getattr(model, f"_keys_to_ignore_on_load_{which}", None) or []
    return [re.compile(p) for p in patterns]


def _is_transformers_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _transformers_conversion() -> tuple | None:
    """transformers' key renaming and conversion (version 5 on), or None before it."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     dot_natural_key, rename_source_key)
    except ImportError:
        return None
    return (rename_source_key, dot_natural_key, get_model_conversion_mapping, WeightRenaming,
            WeightConverter)


@contextlib.contextmanager
def _unsharded_classes(model: nn.Module) -> Iterator[None]:
    """The model's modules with the classes they had before ``fully_shard`` (transformers
    looks conversions up by class name), put back afterwards."""
    swapped = []
    try:
        for module in model.modules():
            before = original_class(module)
            if before is not type(module):
                swapped.append((module, type(module)))
                module.__class__ = before
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
