"""The architecture registry: every architecture module registers its `DecoderLM` subclass by
name (and aliases); the grid, the probes and the cost build models by name from here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from depthbench.util.errors import ConfigError
from depthbench.models.config import ModelConfig

if TYPE_CHECKING:
    from depthbench.models.base import DecoderLM

ARCHITECTURES: dict[str, type["DecoderLM"]] = {}
ALIASES: dict[str, str] = {}


def register(name: str, *aliases: str) -> Callable[[type["DecoderLM"]], type["DecoderLM"]]:
    """Class decorator: make an architecture buildable by `name` (and by its aliases)."""

    def wrap(cls: type[DecoderLM]) -> type[DecoderLM]:
        if name in ARCHITECTURES or name in ALIASES:
            raise ValueError(f"architecture {name!r} registered twice")
        cls.arch_name = name
        ARCHITECTURES[name] = cls
        for alias in aliases:
            ALIASES[alias] = name
        return cls

    return wrap


def canonical_arch(name: str) -> str:
    """The registered name for `name` or one of its aliases; ConfigError when unknown."""
    _import_architectures()
    if name in ARCHITECTURES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise ConfigError(
        "architectures",
        f"unknown architecture {name!r}; valid: {sorted(ARCHITECTURES) + sorted(ALIASES)}",
    )


def registered_architectures() -> list[str]:
    """Every registered architecture name (aliases not included), sorted."""
    _import_architectures()
    return sorted(ARCHITECTURES)


def declared_options(arch: str, options: dict) -> dict:
    """The options `arch` declares (its `Options` dataclass), from a shared `arch_options`
    mapping, with its defaults filled in: what a model of `arch` reads, hence what its run id
    hashes and its model card lists. Keys other architectures declare are left out; a bad value
    of a declared option is a ConfigError naming it."""
    import dataclasses

    return dataclasses.asdict(
        ARCHITECTURES[canonical_arch(arch)].Options.from_mapping(options or {})
    )


def build_model(cfg: ModelConfig, initialize: bool = True) -> "DecoderLM":
    """Instantiate the registered architecture `cfg.arch` on the current device.

    `initialize=False` skips DepthBench's init (used on the meta device, where only shapes matter).
    """
    return ARCHITECTURES[canonical_arch(cfg.arch)](cfg, initialize=initialize)


def _import_architectures() -> None:
    # Importing the package registers every architecture module.
    import depthbench.models.archs  # noqa: F401


def count_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count of the model as built, without allocating memory (meta device)."""
    with torch.device("meta"):
        model = build_model(cfg, initialize=False)
    return model.num_parameters()
