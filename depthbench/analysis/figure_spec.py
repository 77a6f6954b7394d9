"""What a registered figure is (depthbench.analysis.registry): the Figure record, the report's
section names, and the config switches that decide whether a stage's figures are drawn.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


def probes_on(config: dict) -> bool:
    return bool(config.get("probes", {}).get("enabled", True))


def dynamics_on(config: dict) -> bool:
    return int(config.get("train", {}).get("dynamics_every", 0) or 0) > 0


def at_steps_on(config: dict) -> bool:
    return probes_on(config) and bool(config.get("probes", {}).get("at_steps"))


def removal_on(config: dict) -> bool:
    return probes_on(config) and bool(config.get("removal", {}).get("enabled", True))


def nll_on(config: dict) -> bool:
    return bool(config.get("nll", {}).get("enabled", True))


@dataclass(frozen=True)
class Figure:
    name: str
    # The drawing function as "module.function" of depthbench.analysis, imported when drawn: the
    # Snakefile reads the registry to plan the figure rules, and importing the figure modules
    # would import matplotlib (a second of every Snakemake start).
    function: str
    section: str
    rule: str
    tables: tuple[str, ...]
    caption: str
    probes: frozenset[str] = frozenset()  # probe families some architecture must support
    arch_figure: str | None = None  # declared by some architecture in `.figures`
    when: Callable[[dict], bool] = field(default=lambda config: True)

    @property
    def draw(self) -> Callable:
        """(tables: dict[str, DataFrame], ctx: style.Context) -> matplotlib Figure."""
        module, _, function = self.function.rpartition(".")
        return getattr(importlib.import_module(f"depthbench.analysis.{module}"), function)


LOSS, PROBES, DYN, NLL, COST = (
    "1. Loss",
    "2. Layer utilization probes",
    "3. Training dynamics",
    "4. NLL",
    "5. Cost",
)
