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
    config = tiny_config(wiki_jsonl, learning_rates=[3e-3, 1e-2])
    config["nll"] = {**config.get("nll", {}), "enabled": False}
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
    rows, _ = _status(root)
    assert [rows[rid][0] for rid in ids] == ["stale", "stale"] and _plan(root)["train"] == 2
    meta.write_bytes(original)  # newer again, with the bytes Snakemake recorded
    _clean(root, ids)


def test_corrupt_weights_advice_retrains_the_run(workflow):
    root, ids = workflow
    weights = root / "results" / "runs" / ids[0] / "model.safetensors"
    from safetensors.torch import load_file

    good = load_file(weights)
    data = bytearray(weights.read_bytes())
    data[-5] ^= 1
    weights.write_bytes(bytes(data))
    rows, out = _status(root)
    assert rows[ids[0]][0] == "corrupt" and rows[ids[1]][0] in TRAINED
    command = _advice(out, ids[0])
    assert command[:2] == ["snakemake", "--forcerun"]
    _snakemake(root, *command[1:])
    assert load_file(weights).keys() == good.keys()
    _clean(
        root, ids, runs_only=True
    )  # the new weights verify against the digest recorded with them


def test_summary_of_another_run_advice_retrains_it(workflow):
    """Another run's summary copied in with its run id edited to the folder's: Snakemake alone
    redoes nothing (status says so), the printed command retrains it."""
    root, ids = workflow
    a, b = (root / "results" / "runs" / rid / "summary.json" for rid in ids)
    s = json.loads(a.read_text())
    s["run_id"] = s["spec"]["run_id"] = ids[1]
    s["spec_hash"] = RunSpec.from_dict(
        s["spec"]
    ).spec_hash()  # self-consistent: only the grid tells
    b.write_text(json.dumps(s))
    rows, out = _status(root)
    assert rows[ids[1]][0] == "invalid" and rows[ids[1]][3] == "none:" and "grid's spec" in out
    assert "train" not in _plan(root)
    _snakemake(root, *_advice(out, ids[1])[1:])
    assert (
        json.loads(b.read_text())["run_id"] == ids[1]
        and json.loads(b.read_text())["spec_hash"] != s["spec_hash"]
    )
    _clean(root, ids, runs_only=True)


def test_weights_deleted_after_the_tables_advice_retrains_the_run(workflow):
    """A trained run's weights deleted once the tables hold it: Snakemake alone redoes nothing (a
    missing intermediate file reruns no job whose consumers are done), so status does not
    promise a train job but prints the --forcerun that retrains it."""
    root, ids = workflow
    weights = root / "results" / "runs" / ids[0] / "model.safetensors"
    weights.unlink()
    rows, out = _status(root)
    assert rows[ids[0]][0] == "stale" and rows[ids[0]][3] == "none:", out
    assert "train: " not in out and "not redone without --forcerun: 1 run" in out
    assert _plan(root) == {}
    _snakemake(root, *_advice(out, ids[0])[1:])
    assert weights.exists()
    _clean(root, ids, runs_only=True)


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
