"""``--section.field VALUE`` flags onto a :class:`TrainConfig`, and their ``--help``, by tyro.

tyro builds the flags from the dataclasses in train/config/schema.py: one per field, named
``--section.field`` (``--section.field_name`` and ``--section.field-name`` both work),
typed by the annotation, listed in ``--help`` with the docstring written under the field.
TOML values go through the same parser (load_toml, below, turns them into flags), so a
file and a command line accept and refuse the same values.

Why tyro rather than draccus (the two libraries in use for this; torchtitan uses tyro,
levanter draccus): tyro parses each value by its Python type, while draccus parses every
command-line value as YAML first, which turns ``--eval.sample_prompt "ROMEO:"`` into a
mapping and a newline prompt into null; draccus also needs the ``toml`` package, whose
last release was in 2020. tyro reads field docstrings for ``--help``, takes a default
instance (the preset, then the TOML) and lets a field declare its own parser (true,
false, N or auto for ``parallel.reshard_after_forward``). TOML itself is read by tomllib
and written by tomli_w.

tyro reports a refused value in a multi-line box and exits; fullshard's errors are one line
naming the field. tyro calls a parse-error hook first (``tyro._errors.on_parse_error``,
documented but private: pyproject.toml pins tyro to 1.0.x for it), where the failure
becomes a :class:`ConfigError`; a failure that reaches no hook still comes out as one line
(:func:`_one_line`).
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any

import tyro
from tyro import _errors as tyro_errors

from .schema import _FALSE, _TRUE, SECTIONS, TrainConfig, scalar_fields
from ...errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML with the tomli backport
    import tomli as tomllib

PROG = "fullshard train"
COMMAND_LINE = "command line"
# How a refused value is described, by the metavar tyro shows for the field.
_EXPECTED = {"INT": "an int", "FLOAT": "a number", "STR": "text", "true|false": "true/false",
             "true|false|N|auto": "true/false, auto or an int"}

_REGISTRY = tyro.constructors.ConstructorRegistry()


@_REGISTRY.primitive_rule
def _bool_rule(type_info: Any) -> Any:
    """Booleans are written true/false (also yes/no, on/off; any case), as in TOML,
    rather than tyro's True/False."""
    if type_info.type is not bool:
        return None
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar="true|false", instance_from_str=_bool_from_text,
        is_instance=lambda value: isinstance(value, bool),
        str_from_instance=lambda value: ["true" if value else "false"])


def _bool_from_text(args: list[str]) -> bool:
    word = args[0].strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(f"expected true or false, got {args[0]!r}")
    return word in _TRUE


def parse_flags(cfg: TrainConfig, argv: list[str], source: str = COMMAND_LINE) -> TrainConfig:
    """``cfg`` with the ``--section.field VALUE`` flags in ``argv`` applied, as a new
    config (``cfg`` itself when there are none); a refused flag is a ConfigError naming
    the field, and ``source`` where that is a file."""
    if not argv:
        return cfg
    printed = io.StringIO()
    hook = _Hook(argv, source)
    try:
        with tyro_errors.on_parse_error(hook), contextlib.redirect_stderr(printed):
            return tyro.cli(TrainConfig, args=argv, default=cfg, prog=PROG,
                            registry=_REGISTRY, config=(tyro.conf.FlagConversionOff,))
    except SystemExit:
        raise ConfigError(_one_line(printed.getvalue(), source)) from None


def help_text() -> str:
    """What ``fullshard train --help`` lists under the launch and run flags: every config
    field, its type, its docstring and its default (the default preset's)."""
    from .schema import DEFAULT_PRESET, get_preset

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
        tyro.cli(TrainConfig, args=["--help"], default=get_preset(DEFAULT_PRESET), prog=PROG,
                 registry=_REGISTRY, config=(tyro.conf.FlagConversionOff,))
    # The usage line, the class docstring and -h repeat what the run flags' help says.
    return "\n".join(line for line in printed.getvalue().split("\n\n", 2)[-1].splitlines()
                     if not line.lstrip().startswith("-h, --help"))


class _Hook:
    """tyro's parse-error hook: the failure as a one-line ConfigError."""

    def __init__(self, argv: list[str], source: str):
        self.argv, self.source = argv, source

    def __call__(self, event: Any) -> None:
        if isinstance(event, tyro_errors.UnrecognizedArgs):  # named as it was given
            raise ConfigError(f"{self.source}: {self.unknown(event.tokens)}")
        message = self.message(event)
        if message is not None:
            prefix = "" if self.source == COMMAND_LINE else f"{self.source}: "
            raise ConfigError(prefix + message)

    def message(self, event: Any) -> str | None:
        argument = getattr(event, "argument", None)
        if isinstance(event, tyro_errors.InstantiationFailure) and argument is None:
            # A section's own check: GPTConfig's "d_model divisible by n_heads".
            return event.message.splitlines()[0].replace("GPTConfig: ", "gpt: ")
        if argument is None:
            return None
        flags = argument.lowered.name_or_flags
        name = _field_name(flags[0])
        if isinstance(event, tyro_errors.InvalidChoice):
            return f"{name}: accepted values are {', '.join(event.choices)}; got {event.value!r}"
        expected = _EXPECTED.get(str(argument.lowered.metavar), str(argument.lowered.metavar))
        value = self.value_of(flags)
        if value is None:
            return f"{name}: expected {expected}, got no value"
        return f"{name}: expected {expected}, got {value!r}"

    def unknown(self, tokens: list[str]) -> str:
        flag = next((t for t in tokens if t.startswith("--")), None)
        if flag is None:
            return f"unexpected value {tokens[0]!r} (values follow a --section.field flag)"
        dotted = _field_name(flag.split("=", 1)[0])
        section, _, _ = dotted.rpartition(".")
        what = (f"unknown flag --{dotted.replace('_', '-')}" if self.source == COMMAND_LINE
                else f"unknown field {dotted}")
        if section and section not in SECTIONS:
            return f"{what} (sections: {', '.join(SECTIONS)})"
        if not section and self.source == COMMAND_LINE:  # the run and launch flags too
            return f"{what} (see --help)"
        obj = getattr(TrainConfig(), section) if section else TrainConfig()
        names = sorted(f.name for f in scalar_fields(obj))
        return f"{what} (fields there: {', '.join(names)})"

    def value_of(self, flags: tuple[str, ...]) -> str | None:
        """The last value given for the flag in argv (``--x V`` or ``--x=V``)."""
        found = None
        spellings = {_field_name(f) for f in flags}
        for i, token in enumerate(self.argv):
            flag, equals, value = token.partition("=")
            if flag.startswith("--") and _field_name(flag) in spellings:
                if equals:
                    found = value
                elif i + 1 < len(self.argv):
                    found = self.argv[i + 1]
        return found


def _field_name(flag: str) -> str:
    """``--gpt.n-heads`` -> ``gpt.n_heads``."""
    return flag.removeprefix("--").replace("-", "_")


def _one_line(printed: str, source: str) -> str:
    """What tyro printed (a titled box of several lines) as one line: the title and the
    error, without the rules, the field's help and the pointer to --help."""
    parts = []
    for line in printed.splitlines():
        text = line.strip(" │─╭╮╰╯")
        if not text or set(text) <= set("-─ "):
            continue
        if text.startswith(("Argument helptext", "For full helptext", "Perhaps you meant")):
            break
        parts.append(" ".join(text.split()))
    return f"{source}: " + ("; ".join(parts) or "the flags were refused (see --help)")


# -- dotted names and TOML files, through the same parser ------------------------------

def apply_overrides(cfg: TrainConfig, values: dict[str, Any], source: str) -> TrainConfig:
    """A copy of ``cfg`` with ``{"optim.lr": value, ...}`` applied; values are strings as
    typed on a command line, or typed values (from TOML, or Python). ``source`` (the
    file, or "command line") prefixes the error an unknown field or bad value raises."""
    return parse_flags(cfg, [f"--{name}={_as_text(name, value, source)}"
                             for name, value in values.items()], source)


def _as_text(name: str, value: Any, source: str) -> str:
    """A typed value as the text the flag parser reads back to it."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return repr(value)
    # A TOML array, table or date: no field holds one (a string of it would pass as text).
    raise ConfigError(f"{source}: {name}: expected a number, true/false or text, got "
                      f"{value!r}")


def load_toml(cfg: TrainConfig, path: str) -> TrainConfig:
    """``cfg`` with the values of the TOML file at ``path`` applied. TOML mirrors the
    dataclasses: top-level fields, then one table per section."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: no such file {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"--config: {path} is a directory; give a TOML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config: {path} is not UTF-8 text; give a TOML file") from None
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
