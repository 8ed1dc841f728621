"""Checks of the files and directories fullshard commands are given, made when the
arguments are read: a wrong path is one line naming the flag or field, not a traceback
from wherever the path is first opened."""

from __future__ import annotations

import codecs
import json
import os

from ...errors import ConfigError

_CHUNK = 1 << 20


def check_text_file(name: str, path: str) -> None:
    """``path`` is a readable file whose start is UTF-8 text (ConfigError naming ``name``
    otherwise). Only the first MiB is read: the reader of the whole file raises
    :func:`not_text` where a later byte is not UTF-8."""
    if os.path.isdir(path):
        raise ConfigError(f"{name}: {path} is a directory; give a text or JSONL file")
    if not os.path.isfile(path):
        raise ConfigError(f"{name}: no such file {path!r}")
    try:
        with open(path, "rb") as f:
            codecs.getincrementaldecoder("utf-8")().decode(f.read(_CHUNK))
    except UnicodeDecodeError as err:
        raise not_text(name, path, err) from None
    except OSError as err:
        raise ConfigError(f"{name}: cannot read {path} ({err.strerror})") from None


def not_text(name: str, path: str, err: UnicodeDecodeError) -> ConfigError:
    return ConfigError(f"{name}: {path} is not UTF-8 text (byte {err.object[err.start]:#04x} "
                       "cannot be decoded); give a text or JSONL file")


def check_output_dir(name: str, path: str) -> None:
    """``path`` is a directory or can become one (not an existing file)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{name}: {path} is a file, not a directory; give a directory "
                          "(it is created if missing)")


def check_hf_model(name: str, path: str) -> None:
    """``path`` is a Hugging Face model folder or its config.json: a JSON object naming
    its ``model_type``."""
    if not os.path.exists(path):
        raise ConfigError(f"{name}: {path} does not exist; give a Hugging Face model folder "
                          "or its config.json")
    config = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config):
        raise ConfigError(f"{name}: {path} has no config.json; give a Hugging Face model "
                          "folder or its config.json")
    try:
        with open(config, encoding="utf-8") as f:
            fields = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{name}: {config} is not a JSON config ({err}); give a Hugging "
                          "Face model folder or its config.json") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ConfigError(f"{name}: {config} has no \"model_type\"; it is not a Hugging Face "
                          "model config")
