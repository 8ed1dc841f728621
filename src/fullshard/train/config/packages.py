"""Optional packages: what needs them, and the pip extra that installs each.

A run asks for one through its configuration (``--model hf:PATH``,
``--metrics.tensorboard true``, ``--metrics.wandb PROJECT``). :func:`check_packages`
runs where the configuration is resolved, in the launcher and on every rank before
anything collective, so a missing package is one line before training starts rather
than a failure on rank 0 alone while the other ranks wait for it. The packages
themselves are imported only when used (:func:`import_optional`), on the ranks that use
them.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from ..config.schema import ConfigError, TrainConfig

# The field that asks for a package -> (the module imported, the pip extra installing it).
OPTIONAL_PACKAGES = {
    "model": ("transformers", "hf"),
    "metrics.tensorboard": ("tensorboard", "tensorboard"),
    "metrics.wandb": ("wandb", "wandb"),
    "--hf": ("transformers", "hf"),  # fullshard ckpt export --hf
    "lora.rank": ("peft", "quant"),
    "lora.base": ("torchao", "quant"),
    "--adapters": ("peft", "quant"),  # fullshard ckpt export --adapters
}


def missing_package(field: str) -> ConfigError:
    module, extra = OPTIONAL_PACKAGES[field]
    return ConfigError(f"{field}: needs the {module} package, which is not installed; "
                       f"install it with pip install 'fullshard[{extra}]'")


def is_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_packages(cfg: TrainConfig) -> TrainConfig:
    """Raise naming the field whose package is missing; return ``cfg``."""
    asked = {"model": cfg.is_hf, "metrics.tensorboard": cfg.metrics.tensorboard,
             "metrics.wandb": bool(cfg.metrics.wandb), "lora.rank": cfg.lora.rank > 0,
             "lora.base": cfg.lora.rank > 0 and cfg.lora.base == "nf4"}
    for field, wanted in asked.items():
        if wanted and not is_installed(OPTIONAL_PACKAGES[field][0]):
            raise missing_package(field)
    return cfg


def import_optional(field: str) -> ModuleType:
    """The package ``field`` needs, imported now."""
    try:
        return importlib.import_module(OPTIONAL_PACKAGES[field][0])
    except ImportError:
        raise missing_package(field) from None
