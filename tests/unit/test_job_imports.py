"""The table, claims, figure and report jobs start without importing torch: each Snakemake job
is a new interpreter, and torch's import (about 2 s on a laptop core) paid by every aggregate job
of every workflow run is start-up time, not work. The check imports what each entry script
imports, in a fresh interpreter, as Snakemake's job does."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Jobs that read tables and write tables, figures or the report: none of them builds a model.
TORCH_FREE = (
    "tables",
    "lr_sweep",
    "probes_table",
    "nll_table",
    "removal_table",
    "cost_table",
    "claims",
    "figures",
    "report",
)


def script_modules(script: str) -> list[str]:
    """The depthbench modules `scripts/<script>.py` imports at its top level."""
    tree = ast.parse((REPO / "scripts" / f"{script}.py").read_text(encoding="utf-8"))
    found = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("depthbench"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if a.name.startswith("depthbench"))
    return found


def test_aggregate_job_scripts_do_not_import_torch():
    modules = {s: script_modules(s) for s in TORCH_FREE}
    assert all(modules.values()), modules  # each script imports depthbench: the check bites
    code = (
        "import importlib, json, sys\n"
        f"out = {{}}\nfor script, mods in {modules!r}.items():\n"
        "    for m in mods:\n"
        "        importlib.import_module(m)\n"
        "    out[script] = 'torch' in sys.modules\n"
        "print(json.dumps(out))\n"
    )
    # one interpreter, scripts in order: the first that pulls torch in is the one named
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    with_torch = [s for s, loaded in json.loads(proc.stdout).items() if loaded]
    assert not with_torch, f"torch imported by the modules of scripts/{with_torch[0]}.py"
