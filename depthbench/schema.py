"""The config schema (workflow/schemas/config.schema.yaml): the one place every setting's default
lives. A leaf module, so that the stages (probes, NLL) can read their defaults without importing
the grid expansion."""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import yaml

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "config.schema.yaml"


@lru_cache(maxsize=1)
def _schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def load_schema() -> dict:
    """A fresh copy of the schema."""
    return copy.deepcopy(_schema())


def schema_defaults(section: str) -> dict:
    """The defaults the schema gives the fields of one top-level section (`probes`, `nll`, ...),
    for callers that get a partial section."""
    props = _schema()["properties"][section]["properties"]
    return {name: copy.deepcopy(sub["default"]) for name, sub in props.items() if "default" in sub}
