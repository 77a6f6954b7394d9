"""The recovery commands `depthbench status` prints, carried out on the situation each is printed
for, in a copy of the workflow on a tiny real grid: each leaves status and Snakemake clean; and
where status says a run must be redone, Snakemake plans it, and not otherwise."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from depthbench.spec.run import RunSpec
from tests.conftest import REPO, tiny_config

pytestmark = pytest.mark.slow

# A finished run's states: its tiny model may end near the unigram floor (`at-floor`), which
# is a trained run that did not learn, as far as recovery goes the same as `trained`.
TRAINED = ("trained", "at-floor")


def _snakemake(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def _plan(root: Path, *args: str) -> dict[str, int]:
    """Jobs of a dry run by rule ({} when Snakemake has nothing to do)."""
    out = _snakemake(root, "-n", *args).stdout
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


def _status(root: Path) -> tuple[dict[str, list[str]], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "depthbench", "status"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = {
        line.split()[0]: line.split()[1:]
        for line in proc.stdout.splitlines()
        if line.startswith(("pre_ln",))
    }
    return rows, proc.stdout


def _advice(out: str, run_id: str) -> list[str]:
    """The command in the `next` column of run_id's row."""
    (line,) = [line for line in out.splitlines() if line.startswith(run_id)]
    return shlex.split(re.search(r"none: `([^`]+)`", line).group(1))


def _clean(root: Path, ids: list[str], runs_only: bool = False) -> None:
    """Status and Snakemake agree that every run is trained and probed; with `runs_only`, the
    aggregate jobs (figures, report) may still be planned by Snakemake: once a run is retrained
    to other weights, the figures are sometimes planned once more."""
    rows, out = _status(root)
    assert all(rows[rid][0] in TRAINED and rows[rid][1] == "yes" for rid in ids), out
    plan = _plan(root)
    if runs_only:
        assert not {"train", "probe"} & set(plan), plan
    else:
        assert "nothing to do" in out and plan == {}, plan


@pytest.fixture(scope="module")
def workflow(tmp_path_factory, wiki_jsonl):
    root = tmp_path_factory.mktemp("recover")
    for name in ("Snakefile", "workflow", "scripts", "config", "slurm", "envs"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / name)
    # three runs, one for each situation that needs --forcerun; NLL and removal off: no
    # situation here involves them, and each retrain would redo them
    config = tiny_config(wiki_jsonl, learning_rates=[3e-3, 1e-2, 2e-2])
    config["nll"] = {**config.get("nll", {}), "enabled": False}
    config["removal"] = {"enabled": False}
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    _snakemake(root)
    ids = sorted(p.name for p in (root / "results" / "runs").iterdir())
    _clean(root, ids)
    return root, ids


def test_touch_and_content_change_agree_with_snakemake(workflow):
    """A touched small input (same bytes) redoes nothing for Snakemake 9, nor for status; the
    same file with other bytes redoes the runs for both."""
    root, ids = workflow
    (meta,) = (root / "results" / "data").glob("*/meta.json")
    original = meta.read_bytes()
    meta.touch()
    _clean(root, ids)
    meta.write_bytes(original + b"\n")
    try:
        rows, _ = _status(root)
        assert [rows[rid][0] for rid in ids] == ["stale"] * len(ids)
        assert _plan(root)["train"] == len(ids)
    finally:
        meta.write_bytes(original)  # newer again, with the bytes Snakemake recorded
    _clean(root, ids)


def test_each_forcerun_advice_retrains_its_run(workflow, tmp_path):
    """Three runs broken three ways that Snakemake alone does not redo, each reported with the
    `snakemake --forcerun` that trains it again; the three commands' targets, run as one
    Snakemake call as a user with three broken runs would, leave status and Snakemake clean.

    - corrupt weights (a flipped byte): the row says `corrupt`;
    - another run's summary copied in, with its run id edited to the folder's and its spec hash
      made self-consistent: only the grid tells, and the row says `invalid` with the grid's spec;
    - weights deleted once the tables hold the run: Snakemake reruns no job whose consumers are
      done, so status promises no train job and says the run is not redone without --forcerun.
    """
    from safetensors.torch import load_file

    root, ids = workflow
    corrupt, invalid, deleted = ids
    runs = root / "results" / "runs"
    # the module's later tests share these runs: a failure here puts them back as they were
    saved = tmp_path / "runs"
    for rid in ids:
        shutil.copytree(runs / rid, saved / rid)
    done = False
    try:
        # a missing intermediate file reruns no job whose consumers are done: nothing is planned
        (runs / deleted / "model.safetensors").unlink()
        assert _plan(root) == {}

        weights = runs / corrupt / "model.safetensors"
        good = load_file(weights)
        data = bytearray(weights.read_bytes())
        data[-5] ^= 1
        weights.write_bytes(bytes(data))

        summary = runs / invalid / "summary.json"
        copied = json.loads((runs / corrupt / "summary.json").read_text())
        copied["run_id"] = copied["spec"]["run_id"] = invalid
        copied["spec_hash"] = RunSpec.from_dict(copied["spec"]).spec_hash()
        summary.write_text(json.dumps(copied))

        rows, out = _status(root)
        assert rows[corrupt][0] == "corrupt", out
        assert (
            rows[invalid][0] == "invalid" and rows[invalid][3] == "none:" and "grid's spec" in out
        )
        assert rows[deleted][0] == "stale" and rows[deleted][3] == "none:", out
        assert "train: " not in out and "not redone without --forcerun: 1 run" in out
        assert "train" not in _plan(root)

        commands = [_advice(out, rid) for rid in (corrupt, invalid, deleted)]
        assert all(command[:2] == ["snakemake", "--forcerun"] for command in commands), commands
        _snakemake(root, "--forcerun", *(target for command in commands for target in command[2:]))

        assert load_file(weights).keys() == good.keys()
        rewritten = json.loads(summary.read_text())
        assert rewritten["run_id"] == invalid and rewritten["spec_hash"] != copied["spec_hash"]
        assert (runs / deleted / "model.safetensors").exists()
        # the new weights verify against the digests recorded with them
        _clean(root, ids, runs_only=True)
        done = True
    finally:
        if not done:
            for rid in ids:
                shutil.rmtree(runs / rid, ignore_errors=True)
                shutil.copytree(saved / rid, runs / rid)


def test_incomplete_marker_is_reported_as_snakemake_sees_it(workflow):
    from depthbench.commands.snakemake_records import snakemake_record as record_path

    root, ids = workflow
    summary = root / "results" / "runs" / ids[0] / "summary.json"
    marker = record_path(root, "incomplete", summary)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text('{"external_jobid": null}')
    try:
        rows, out = _status(root)
        assert rows[ids[0]][0] == "incomplete" and "--rerun-incomplete" in out
        refused = _snakemake(root, "-n", check=False)
        assert refused.returncode != 0 and "Incomplete files" in refused.stdout + refused.stderr
        assert _plan(root, "--rerun-incomplete")["train"] == 1
    finally:
        marker.unlink()
