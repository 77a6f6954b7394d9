"""Jobs that build no model import no torch: each Snakemake job is a new interpreter, and
torch's import (about 2 s on a laptop core) paid by every such job of every workflow run is
start-up time, not work. The table, claims, figure and report jobs start without it (the check
imports what each entry script imports); the figures, the tokenizer and tokenize jobs on a local
corpus, the nll_sets job, a diverged run's NLL job and the removal table also run without it,
each in a fresh interpreter, as Snakemake's job does."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_every_figure_draws_without_importing_torch(tmp_path):
    """Drawing, not only importing: a figure of each drawing module, among those a grid of
    pre_ln, hc, mhc and attnres_block gets (hc's residual-product rank and attnres_block's dead
    zone included), drawn in a fresh interpreter from tables read as the figure job reads them,
    imports no torch: the colours come from the registry's order without its modules. (Which
    figures a grid gets is the Snakefile's question, and the synthetic tables are built, here in
    the test's process.)"""
    from depthbench.analysis import registry
    from tests.analysis_tables import synthetic_tables

    archs = ["pre_ln", "hc", "mhc", "attnres_block"]
    by_module = {}
    for name in registry.grid_figures(archs, {"train": {"dynamics_every": 5}}):
        by_module.setdefault(registry.FIGURES[name].draw.__module__, name)
    names = list(by_module.values())
    paths = {}
    for table, df in synthetic_tables(archs=archs).items():
        paths[table] = str(tmp_path / f"{table}.parquet")
        df.to_parquet(paths[table])
    code = (
        "import sys\n"
        "from depthbench.analysis import registry\n"
        "from depthbench.analysis.readers import read_tables\n"
        f"tables = read_tables({paths!r})\n"
        "ctx = registry.context({'name': 'syn', 'figures': {'dpi': 30}})\n"  # speed, not looks
        f"for name in {names!r}:\n"
        f"    registry.render(name, tables, ctx, {str(tmp_path)!r} + f'/{{name}}.png',"
        f" {str(tmp_path)!r} + f'/{{name}}.pdf')\n"
        "    assert 'torch' not in sys.modules, name\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(names) >= 8 and len(list(tmp_path.glob("*.png"))) == len(names), names


@pytest.mark.slow
def test_the_figure_registry_plans_without_matplotlib():
    """The Snakefile reads the figure registry on every start (which figures a grid gets, the
    tables each reads): that read imports no matplotlib (about a second); the drawing functions
    are imported when drawn, and each entry names one that exists."""
    code = (
        "import sys\n"
        "from depthbench.analysis import registry\n"
        "registry.of_rule(list(registry.FIGURES), 'figures')\n"
        "registry.tables_of(list(registry.FIGURES))\n"
        "assert 'matplotlib' not in sys.modules\n"
        "assert all(callable(f.draw) for f in registry.FIGURES.values())\n"
        "print(len(registry.FIGURES))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout) >= 20


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "text"])
def test_tokenizer_and_tokenize_jobs_on_a_local_corpus_import_neither_datasets_nor_torch(
    tmp_path, wiki_jsonl, fmt
):
    """A local JSON-lines or text corpus is read without `datasets` (which imports torch and
    pandas, about 3 s of each of the two jobs): the tokenizer and the token shards are built in
    a fresh interpreter, as the jobs build them, from the documents `datasets` reads (their
    equality is tested in test_tokenize_ranges.py)."""
    from depthbench.data.corpus import iter_documents
    from depthbench.spec.schema import load_config
    from tests.conftest import tiny_config

    path = wiki_jsonl
    if fmt == "text":
        docs = [json.loads(line)["text"].replace("\n\n", " ") for line in wiki_jsonl.open()]
        path = tmp_path / "wiki.txt"
        path.write_text("\n\n".join(docs) + "\n")
    config = load_config(tiny_config(path))
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = (
        "import json, sys\n"
        "from depthbench.data.prepare import build_shards, build_tokenizer\n"
        f"config = json.load(open({str(tmp_path / 'config.json')!r}))\n"
        f"build_tokenizer(config, {str(tmp_path / 'tok.json')!r})\n"
        f"meta = build_shards(config, {str(tmp_path / 'tok.json')!r}, "
        f"{str(tmp_path / 'shards')!r}, 'd', 't')\n"
        "print(json.dumps({'docs': meta['train']['n_documents'] + meta['val']['n_documents'],"
        " 'imported': sorted({'datasets', 'torch', 'pandas'} & set(sys.modules))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["imported"] == [], out
    assert out["docs"] == len(list(iter_documents(config["corpus"]))) > 300


@pytest.mark.slow
def test_the_removal_table_job_merges_rows_and_effective_depths_without_torch(tmp_path):
    """The removal_table job computes effective depth from the runs' removal rows (pandas only):
    it runs in a fresh interpreter without torch, on the rows of two runs."""
    from depthbench.probes.effective_depth import COLUMNS
    from tests.analysis_tables import synthetic_tables

    tables = synthetic_tables(archs=("pre_ln", "hc"), depths=(4, 8))
    paths = {}
    for name in ("runs", "best_lr"):
        paths[name] = str(tmp_path / f"{name}.parquet")
        tables[name].to_parquet(paths[name])
    rows = tables["removal"]
    per_run = []
    for run_id, g in rows.groupby("run_id"):
        per_run.append(str(tmp_path / f"{run_id}.parquet"))
        g[["run_id", *COLUMNS, "status"]].to_parquet(per_run[-1])
    code = (
        "import json, sys\n"
        "import pandas as pd\n"
        "from depthbench.analysis.stage_tables import removal_tables\n"
        f"runs, best = pd.read_parquet({paths['runs']!r}), pd.read_parquet({paths['best_lr']!r})\n"
        f"removal, depth = removal_tables({per_run!r}, runs, best, 0.05)\n"
        "print(json.dumps([len(removal), len(depth), 'torch' in sys.modules]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n_removal, n_depth, torch_loaded = json.loads(proc.stdout)
    assert n_removal == len(rows) and n_depth == len(tables["effective_depth"]) > 0
    assert not torch_loaded


@pytest.mark.slow
def test_nll_sets_and_the_nll_and_removal_of_a_diverged_run_import_no_torch(tiny_data, tmp_path):
    """The nll_sets job tokenizes the evaluation sets, and the NLL and removal jobs of a diverged
    run write their rows without numbers (the removal job none at all): none builds a model, and
    in a fresh interpreter none imports torch (about 1.5-2 s of each job)."""
    import copy

    from depthbench.train.loop import train
    from depthbench.train.recipe import RunPaths

    _, exp, shards = tiny_data
    spec = copy.deepcopy(next(iter(exp.runs.values())))
    spec.lr = spec.train.lr = 50.0  # diverges at once
    run_dir = tmp_path / "runs" / spec.run_id  # the stage checks that the folder is the run's
    assert (
        train(spec, shards, RunPaths(run_dir, tmp_path / "work"), progress=False)["status"]
        == "diverged"
    )
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    settings = {"sets": ["humaneval", "gsm8k"], "max_docs_per_set": 3}
    probe_settings = {"n_sequences": 4, "seed": 0, "seq_len": None}
    code = (
        "import json, sys\n"
        "import pandas as pd\n"
        "from depthbench.evals.run import build_sets, run_nll\n"
        "from depthbench.probes.removal_run import run_removal\n"
        f"settings = {settings!r}\n"
        f"spec = json.load(open({str(tmp_path / 'spec.json')!r}))\n"
        f"build_sets(settings, {str(shards.parent / 'tokenizer.json')!r}, None, 'sets.parquet')\n"
        "loaded = 'torch' in sys.modules\n"
        f"run_nll(spec, {str(run_dir)!r}, 'sets.parquet', 'nll.parquet', settings)\n"
        "after_nll = 'torch' in sys.modules\n"
        # the probe rows are not read for a diverged run: the path names no file
        f"run_removal(spec, {str(shards)!r}, {str(run_dir)!r}, 'no-probes.parquet', "
        f"'sets.parquet', 'removal.parquet', {{}}, {probe_settings!r})\n"
        "t, r = pd.read_parquet('nll.parquet'), pd.read_parquet('removal.parquet')\n"
        "print(json.dumps([loaded, after_nll, 'torch' in sys.modules, sorted(set(t.status)),"
        " int(t.nats_per_token.notna().sum()), sorted(set(t.loc[t.level == 'set', 'set'])),"
        " len(r), list(r.columns)]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    after_sets, after_nll, after_removal, status, numbers, sets, removal_rows, columns = json.loads(
        proc.stdout
    )
    assert (after_sets, after_nll, after_removal) == (False, False, False)
    assert status == ["diverged"] and numbers == 0 and sets == ["gsm8k", "humaneval"]
    assert removal_rows == 0 and columns[0] == "run_id" and columns[-1] == "status"
