"""State dicts and distributed checkpoints for fullshard models."""

from .hf_load import load_hf, parameters_on_meta
from .io import CheckpointError, load, read_manifest, resolve, save
from .state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                         get_state_dict, set_model_state_dict, set_optimizer_state_dict,
                         set_state_dict)
from .verify import Checkpoint, Kind, UnverifiedCheckpointWarning, classify, open_checkpoint

__all__ = [
    "save", "load", "resolve", "read_manifest", "CheckpointError", "StateDictOptions",
    "get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict",
    "set_optimizer_state_dict", "get_state_dict", "set_state_dict", "open_checkpoint",
    "classify", "Checkpoint", "Kind", "UnverifiedCheckpointWarning", "load_hf",
    "parameters_on_meta",
]
