"""Reading and writing :class:`TrainConfig`: TOML files, ``--section.field`` strings, help.

TOML mirrors the dataclasses: top-level fields first, then one table per section::

    steps = 600
    [optim]
    lr = 0.002

A field whose value is None (``parallel.reshard_after_forward = auto``) is written as a
comment, since TOML has no null.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import sys
import types
import typing
from typing import Any

from .config import SECTIONS, ConfigError, TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML with the tomli backport
    import tomli as tomllib

_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}
_NONE = {"auto", "none"}


def sections(cfg: TrainConfig) -> list[tuple[str, Any]]:
    """(prefix, dataclass) pairs: the top level ("") then each section ("optim." ...)."""
    return [("", cfg)] + [(f"{name}.", getattr(cfg, name)) for name in SECTIONS]


def scalar_fields(obj: Any) -> list[dataclasses.Field]:
    """The fields of ``obj`` that hold values (not nested sections)."""
    return [f for f in dataclasses.fields(obj) if f.name not in SECTIONS]


@functools.lru_cache(maxsize=None)
def type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring: the string literal written on the line after it."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def describe_type(hint: Any) -> str:
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    words = {bool: "true/false", int: "an int", float: "a number", str: "text",
             type(None): "auto"}
    return " or ".join(words[o] for o in options)


def metavar(hint: Any) -> str:
    """How ``--help`` shows a field's value: INT, NUMBER, TEXT, BOOL, BOOL|INT|auto."""
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    words = {bool: "BOOL", int: "INT", float: "NUMBER", str: "TEXT", type(None): "auto"}
    return "|".join(words[o] for o in options)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def parse_value(name: str, text: str, hint: Any) -> Any:
    """Turn the command-line string for field ``name`` into a value of type ``hint``."""
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    word = text.strip().lower()
    if type(None) in options and word in _NONE:
        return None
    if bool in options and word in _TRUE | _FALSE:
        return word in _TRUE
    if int in options:
        try:
            return int(text)
        except ValueError:
            pass
    if float in options:
        try:
            value = float(text)
            if math.isfinite(value):
                return value
        except ValueError:
            pass
    if str in options:
        return text
    raise ConfigError(f"{name}: expected {describe_type(hint)}, got {text!r}")


def check_value(name: str, value: Any, hint: Any) -> Any:
    """Accept a TOML value for field ``name`` if its type fits ``hint`` (ints as floats)."""
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    if isinstance(value, bool):
        if bool in options:
            return value
    elif isinstance(value, int) and int in options:
        return value
    elif isinstance(value, (int, float)) and float in options:
        return float(value)
    elif isinstance(value, str) and str in options:
        return value
    raise ConfigError(f"{name}: expected {describe_type(hint)}, got {value!r}")


def apply_overrides(cfg: TrainConfig, values: dict[str, Any], source: str) -> TrainConfig:
    """A copy of ``cfg`` with ``{"optim.lr": value, ...}`` applied; values are strings from
    the command line or already-typed values from TOML."""
    updates: dict[str, dict[str, Any]] = {}
    for dotted, value in values.items():
        section, _, name = dotted.rpartition(".")
        if section and section not in SECTIONS:
            raise ConfigError(f"{source}: unknown field {dotted} (sections: "
                              f"{', '.join(SECTIONS)})")
        obj = getattr(cfg, section) if section else cfg
        if name not in _names(obj):
            raise ConfigError(f"{source}: unknown field {dotted} (fields there: "
                              f"{', '.join(sorted(_names(obj)))})")
        hint = type_hints(type(obj))[name]
        # Strings go through the parser: command-line text, and TOML's "auto" or "true".
        typed = (parse_value(dotted, value, hint) if isinstance(value, str)
                 else check_value(dotted, value, hint))
        updates.setdefault(section, {})[name] = typed
    top = updates.pop("", {})
    try:
        replaced = {s: dataclasses.replace(getattr(cfg, s), **u) for s, u in updates.items()}
    except ValueError as err:  # GPTConfig's own checks (d_model divisible by n_heads)
        raise ConfigError("gpt: " + str(err).splitlines()[0].removeprefix("GPTConfig: ")) from None
    return dataclasses.replace(cfg, **top, **replaced)


def _names(obj: Any) -> set[str]:
    return {f.name for f in scalar_fields(obj)}


def load_toml(cfg: TrainConfig, path: str) -> TrainConfig:
    """``cfg`` with the values of the TOML file at ``path`` applied."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in SECTIONS:
                raise ConfigError(f"{path}: unknown section [{key}] (sections: "
                                  f"{', '.join(SECTIONS)})")
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return apply_overrides(cfg, flat, path)


def to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as TOML that :func:`load_toml` reads back to an equal config."""
    lines = ["# fullshard train: the resolved configuration of this run"]
    for prefix, obj in sections(cfg):
        if prefix:
            lines += ["", f"[{prefix[:-1]}]"]
        for f in scalar_fields(obj):
            value = getattr(obj, f.name)
            if value is None:
                lines.append(f"# {f.name} = \"auto\"")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a JSON string is a valid TOML basic string
