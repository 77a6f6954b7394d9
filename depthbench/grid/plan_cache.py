"""The grid's expansion, cached: a Snakemake call (or `depthbench status`) on a config it has
expanded before takes the validated config, the Experiment and the grid's figures from
`results/.cache/plans/` instead of validating and expanding again.

Why: the schema lists the registered architectures and their options, the shape solver counts
parameters on models built on the meta device, and the figures a grid gets are its
architectures' declarations, so all three import every architecture module and torch with it:
seconds of every Snakemake call, dry runs and "Nothing to be done" included, for a result that
depends only on the config and DepthBench's own code.

The key hashes everything the expansion computes from:
- the config as Snakemake merged it (before defaults), and the command line's `--config` values,
  which `coerce_command_line` reads by the schema's types;
- the bytes of every file of the `depthbench` package and of the schema (a code change, an added
  architecture or option, a new default: another key);
- the Python, torch and jsonschema versions (the modules that parameter counts and validation
  come from).

What the expansion reads from outside them is read again on every call, cached or not: the
corpus files and the head of their contents, the tokenizer file and its digest, the NLL sets,
the pretrained checkpoints and the SLURM partitions (`check_named`, `tokenizer_id`, `data_id`).
A cached plan whose vocabulary size, tokenizer id or data id then differs is expanded afresh, and
a config that fails validation is never cached, so its error is raised on every call.

Entries are JSON (reading one runs no code), written atomically (a crashed writer leaves no
partial entry, and its temporary file is removed once an hour old; an unreadable entry is a
miss), and only the newest `KEEP` are kept. A plan that JSON cannot hold exactly is not cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

from depthbench.grid.expand import Experiment

PACKAGE = Path(__file__).resolve().parents[1]
FORMAT = 2  # bump when the entry's layout changes
KEEP = 32  # entries kept: one per config a user (or a test suite) plans
STRAY_AGE_S = 3600  # a temporary file this old is a killed writer's, removed with the old entries


def package_digest(package: Path = PACKAGE) -> str:
    """sha256 over the path and bytes of every file of the package (compiled files and caches
    left out) and over the schema's bytes: what the expansion's code is."""
    from depthbench.spec.schema import SCHEMA_PATH

    digest = hashlib.sha256()
    files = sorted(
        p
        for p in package.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so")
    )
    for name, path in [(str(p.relative_to(package)), p) for p in files] + [
        ("<schema>", SCHEMA_PATH)
    ]:
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def _canonical(value):
    """`value` with every mapping as its items sorted by (key type, key repr): a form whose repr
    tells apart everything the planner could (1 and "1" as keys, a date and its string) and that
    sorts keys of mixed types, which YAML allows and the schema then refuses by name."""
    if isinstance(value, dict):
        items = [((type(k).__name__, repr(k)), _canonical(v)) for k, v in value.items()]
        return ("dict", tuple(sorted(items, key=lambda item: item[0])))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canonical(v) for v in value))
    return value


def plan_key(config: dict, command_line: dict) -> str:
    """The cache key of a config as given (before defaults) and its `--config` values."""
    ident = {
        "format": FORMAT,
        "config": _canonical(config),
        "command_line": _canonical(command_line),
        "package": package_digest(),
        "python": sys.version,
        "torch": _version("torch"),
        "jsonschema": _version("jsonschema"),
    }
    return hashlib.sha256(repr(sorted(ident.items())).encode()).hexdigest()


@dataclass
class PlannedGrid:
    experiment: Experiment
    figures: list[str]  # the grid's figures (depthbench.analysis.registry.grid_figures)


def plan_fresh(config: dict, command_line: dict) -> PlannedGrid:
    """Validate `config` in place (defaults filled, `--config` strings read by type), expand its
    grid and list its figures: what a miss computes. Raises the ConfigError naming the first bad
    field."""
    from depthbench.analysis.registry import grid_figures
    from depthbench.grid.config import expand_grid
    from depthbench.spec.schema import coerce_command_line, validate_schema

    coerce_command_line(config, command_line)
    validate_schema(config)
    exp = expand_grid(config)
    return PlannedGrid(exp, grid_figures([spec.arch for spec in exp.runs.values()], config))


def _external_facts(config: dict) -> tuple:
    """What the expansion reads from outside the config and the package, read now."""
    from depthbench.grid.checks import check_named
    from depthbench.grid.ids import data_id, tokenizer_id

    return check_named(config), tokenizer_id(config), data_id(config)


def planned_grid(
    config: dict,
    command_line: dict | None = None,
    cache_dir: str | os.PathLike = "results/.cache/plans",
    fresh: Callable[[dict, dict], PlannedGrid] = plan_fresh,
) -> PlannedGrid:
    """The plan of `config` (Snakemake's merged config, validated and filled in place, as
    `plan_fresh` leaves it), from the cache when this config, these `--config` values and this
    code were planned before and what it reads from outside is unchanged; else planned afresh
    and cached."""
    command_line = command_line or {}
    key = plan_key(config, command_line)
    entry = Path(cache_dir) / f"{key}.json"
    plan = _read(entry)
    if plan is not None:
        exp = plan.experiment
        facts = _external_facts(exp.config)  # raises the ConfigError of a file gone bad
        if facts == (exp.vocab_size, exp.tokenizer_id, exp.data_id):
            config.clear()
            config.update(exp.config)
            exp.config = config
            return plan
    plan = fresh(config, command_line)
    _write(entry, plan)
    return plan


def encode(plan: PlannedGrid) -> dict:
    """The plan as JSON-able data: the config, the ids, and each run spec's `to_dict`."""
    exp = plan.experiment
    return {
        "format": FORMAT,
        "config": exp.config,
        "vocab_size": exp.vocab_size,
        "tokenizer_id": exp.tokenizer_id,
        "data_id": exp.data_id,
        "runs": {rid: spec.to_dict() for rid, spec in exp.runs.items()},
        "replicates": {
            rid: {r: spec.to_dict() for r, spec in replicas.items()}
            for rid, replicas in exp.replicates.items()
        },
        "extensions": {rid: spec.to_dict() for rid, spec in exp.extensions.items()},
        "figures": plan.figures,
    }


def decode(data: dict) -> PlannedGrid:
    from depthbench.spec.run import RunSpec

    exp = Experiment(
        config=data["config"],
        vocab_size=data["vocab_size"],
        tokenizer_id=data["tokenizer_id"],
        data_id=data["data_id"],
        runs={rid: RunSpec.from_dict(d) for rid, d in data["runs"].items()},
        replicates={
            rid: {r: RunSpec.from_dict(d) for r, d in replicas.items()}
            for rid, replicas in data["replicates"].items()
        },
        extensions={rid: RunSpec.from_dict(d) for rid, d in data["extensions"].items()},
    )
    return PlannedGrid(exp, list(data["figures"]))


def _read(entry: Path) -> PlannedGrid | None:
    """The entry's plan; None for a missing, truncated, damaged or foreign entry (a miss, which
    the caller rewrites). JSON, not pickle: reading an entry runs no code."""
    try:
        data = json.loads(entry.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        plan = decode(data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    try:
        os.utime(entry)  # the newest are kept
    except OSError:
        pass
    return plan


def _write(entry: Path, plan: PlannedGrid) -> None:
    """Atomically, and only where the results folder can be written: a read-only checkout still
    plans (uncached). Only a plan that JSON gives back exactly is written (the same repr: 1 is not
    1.0, a tuple not a list), since Snakemake compares the params the rules take from it with
    those of the jobs that ran; any other plan is planned afresh on every start."""
    from depthbench.util.io import atomic_write

    try:  # a value JSON has no form for (a YAML date in launcher.slurm.extra) is not cached
        text = json.dumps(encode(plan), allow_nan=True)
        if repr(decode(json.loads(text))) != repr(plan):
            return
    except (ValueError, KeyError, TypeError):
        return
    try:
        atomic_write(entry, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
        entries = sorted(entry.parent.glob("*.json"), key=lambda p: p.stat().st_mtime)
        # a writer killed before its rename leaves its temporary file; one an hour old is no
        # write in progress (a write takes milliseconds)
        strays = [
            p for p in entry.parent.glob(".*.tmp") if p.stat().st_mtime < time.time() - STRAY_AGE_S
        ]
        for old in entries[:-KEEP] + strays:
            old.unlink(missing_ok=True)
    except OSError:
        pass
