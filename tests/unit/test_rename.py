"""`depthbench rename-runs`: results under the ids of whole-section option hashing move to the
current ids, with the ids inside the files rewritten and modification times kept; conflicts
refuse the whole rename; a dry run changes nothing."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pandas as pd
import pytest

from depthbench.grid.config import expand_grid, shared_options_ids
from depthbench.spec.schema import load_config
from depthbench.util.errors import DataError
from depthbench.util.io import atomic_write_json
from depthbench.commands.rename import plan_renames, rename_runs
from depthbench.train.runcheck import read_summary
from depthbench.train import listing
from depthbench.train.checkpoint_folder import MANIFEST, checksum_path
from tests.conftest import tiny_config


@pytest.fixture
def grid(wiki_jsonl):
    config = tiny_config(
        wiki_jsonl,
        architectures=["pre_ln", "attnres_block"],
        model={"n_head": 2, "arch_options": {"n_blocks": 2}},
    )
    return expand_grid(load_config(config))


def legacy(exp, new):
    old = shared_options_ids(exp)[new]
    spec = exp.runs[new]
    return replace(
        spec,
        run_id=old,
        model=replace(spec.model, arch_options=dict(exp.config["model"]["arch_options"])),
    )


def write_old_run(results, spec, checkpoint=True):
    """The files a run leaves under its id, as the whole-section version wrote them."""
    rid = spec.run_id
    run = results / "runs" / rid
    run.mkdir(parents=True)
    atomic_write_json(
        run / "summary.json",
        {
            "run_id": rid,
            "status": "ok",
            "spec": spec.to_dict(),
            "steps": 4,
            "final_val_loss": 5.0,
            "n_params": 1,
            "spec_hash": spec.spec_hash(),
        },
    )
    (run / "model.safetensors").write_bytes(b"weights")
    (run / "metrics.jsonl").write_text('{"step": 4}\n')
    pd.DataFrame({"run_id": [rid, rid], "value": [1.0, 2.0]}).to_parquet(
        results / "probes" / f"{rid}.parquet"
    )
    (results / "logs" / "train" / f"{rid}.log").write_text("log\n")
    if checkpoint:
        step = results / "work" / rid / "step_00000004"
        step.mkdir(parents=True)
        atomic_write_json(
            step / MANIFEST,
            {"format": "depthbench-dcp-1", "run_id": rid, "step": 4, "world_size": 1, "meta": {}},
        )
        listing.write_listing(step, checksum_path(step).name, [MANIFEST])
    for path in [run / "summary.json", results / "probes" / f"{rid}.parquet"]:
        os.utime(path, (1_700_000_000, 1_700_000_000))


@pytest.fixture
def results(tmp_path):
    for sub in ("runs", "probes", "logs/train"):
        (tmp_path / "results" / sub).mkdir(parents=True)
    return tmp_path / "results"


def test_rename_moves_every_path_and_rewrites_the_ids_inside(grid, results):
    olds = {new: legacy(grid, new) for new in grid.runs}
    assert all(spec.run_id != new for new, spec in olds.items())  # every id of this grid changed
    for spec in olds.values():
        write_old_run(results, spec)
    plan = rename_runs(grid, results)
    assert len(plan.renames) == len(grid.runs) and not plan.conflicts and not plan.stale
    for new, old in olds.items():
        for gone in (
            f"runs/{old.run_id}",
            f"work/{old.run_id}",
            f"probes/{old.run_id}.parquet",
            f"logs/train/{old.run_id}.log",
        ):
            assert not (results / gone).exists(), gone
        summary_path = results / "runs" / new / "summary.json"
        s = read_summary(summary_path, {new: grid.runs[new].spec_hash()})  # what the tables accept
        assert s["run_id"] == s["spec"]["run_id"] == new
        assert s["spec"]["model"]["arch_options"] == grid.runs[new].model.arch_options
        assert (
            summary_path.stat().st_mtime == 1_700_000_000
        )  # Snakemake's mtime trigger sees no change
        probes = results / "probes" / f"{new}.parquet"
        assert (
            set(pd.read_parquet(probes)["run_id"]) == {new}
            and probes.stat().st_mtime == 1_700_000_000
        )
        assert (results / "runs" / new / "model.safetensors").read_bytes() == b"weights"
        assert (results / "logs" / "train" / f"{new}.log").is_file()
        step = results / "work" / new / "step_00000004"
        assert json.loads((step / MANIFEST).read_text())["run_id"] == new
        assert listing.read_listing(checksum_path(step)) == {
            MANIFEST: listing.file_sha256(step / MANIFEST)
        }
    assert plan_renames(grid, results).renames == []  # done: a second run finds nothing


def test_dry_run_lists_and_changes_nothing(grid, results, capsys):
    from depthbench.commands.cli import main

    new = next(iter(grid.runs))
    old = legacy(grid, new)
    write_old_run(results, old)
    before = sorted(str(p.relative_to(results)) for p in results.rglob("*"))
    config = results.parent / "config.yaml"
    config.write_text(json.dumps(grid.config))
    assert main(["rename-runs", str(config), "--results", str(results), "--dry-run"]) in (0, None)
    out = capsys.readouterr().out
    assert f"{old.run_id} -> {new}" in out and "would move" in out and "nothing changed" in out
    assert sorted(str(p.relative_to(results)) for p in results.rglob("*")) == before


def test_a_conflict_refuses_everything(grid, results):
    first, second = list(grid.runs)[:2]
    for new in (first, second):
        write_old_run(results, legacy(grid, new), checkpoint=False)
    (results / "probes" / f"{second}.parquet").write_bytes(
        b"someone else's"
    )  # target exists beside its source
    before = sorted(str(p.relative_to(results)) for p in results.rglob("*"))
    with pytest.raises(
        DataError, match=rf"(?s)refused, nothing changed.*probes/{second}\.parquet exists"
    ):
        rename_runs(grid, results)
    assert sorted(str(p.relative_to(results)) for p in results.rglob("*")) == before


def test_a_run_of_another_spec_is_left_alone(grid, results):
    new = next(iter(grid.runs))
    old = legacy(grid, new)
    other = replace(old, train=replace(old.train, weight_decay=0.5))  # trained for another config
    write_old_run(results, replace(other, run_id=old.run_id), checkpoint=False)
    plan = rename_runs(grid, results)
    assert plan.renames == [] and len(plan.stale) == 1 and old.run_id in plan.stale[0]
    assert (results / "runs" / old.run_id / "summary.json").is_file()
