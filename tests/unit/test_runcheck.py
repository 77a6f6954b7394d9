"""A finished run's files checked before any stage reads them (depthbench.train.runcheck): the final
weights against the digest recorded with them, the summary against the run's identity, and
`depthbench status` reporting what it finds with advice that names the command."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.util.errors import DataError
from depthbench.train.runcheck import WEIGHTS_DIGEST, CorruptWeights, check_run
from tests.conftest import status_grid, tiny_config

INLINE = {"backend": "inline"}


def _flip_byte(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """(spec, run folder named by its run id, data dir) of a short real run."""
    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train

    _, exp, data_dir = tiny_data
    spec = copy.deepcopy(next(iter(exp.runs.values())))
    spec.train.total_steps = 4
    root = tmp_path_factory.mktemp("checked")
    paths = RunPaths(
        root / "results" / "runs" / spec.run_id, root / "results" / "work" / spec.run_id
    )
    train(spec, data_dir, paths, progress=False)
    return spec, paths.run_dir, data_dir


def _copy_run(run_dir: Path, root: Path) -> Path:
    dest = root / "results" / "runs" / run_dir.name
    shutil.copytree(run_dir, dest)
    return dest


def test_training_records_the_digest_of_the_weights_it_publishes(trained):
    _, run_dir, _ = trained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (
        summary[WEIGHTS_DIGEST]
        == hashlib.sha256((run_dir / "model.safetensors").read_bytes()).hexdigest()
    )
    assert check_run(run_dir)["run_id"] == run_dir.name


def test_a_flipped_byte_in_the_final_weights_is_refused_by_every_stage_before_any_work(
    trained, tmp_path
):
    """Probe, NLL (in the job and in the dispatcher, before submission) and export name the file;
    the data folder and NLL sets given do not exist, so any work before the check would fail
    differently, and nothing is written."""
    from depthbench.evals.run import run_nll
    from depthbench.hf.export import export_run
    from depthbench.launch.local import dispatch_nll, dispatch_probes
    from depthbench.probes.run import run_probes

    spec, source, _ = trained
    run_dir = _copy_run(source, tmp_path)
    _flip_byte(run_dir / "model.safetensors")
    weights = re.escape(str(run_dir / "model.safetensors"))
    nowhere, out = tmp_path / "no-data", tmp_path / "out.parquet"
    settings = {"n_sequences": 2, "seq_len": 16}
    calls = {
        "run_probes": lambda: run_probes(
            spec.to_dict(), str(nowhere), str(run_dir), str(out), settings
        ),
        "run_nll": lambda: run_nll(spec.to_dict(), str(run_dir), str(nowhere), str(out), {}),
        "dispatch_probes": lambda: dispatch_probes(
            spec, str(nowhere), str(run_dir), str(tmp_path / "w"), str(out), settings, INLINE
        ),
        "dispatch_nll": lambda: dispatch_nll(
            spec, str(run_dir), str(tmp_path / "w"), str(nowhere), str(out), {}, INLINE
        ),
        "export": lambda: export_run(run_dir, tmp_path / "export"),
    }
    for name, call in calls.items():
        with pytest.raises(CorruptWeights, match=weights + ": corrupt.*--forcerun " + weights):
            call()
    assert not out.exists() and not (tmp_path / "export").exists() and not (tmp_path / "w").exists()


def _fake_run(results: Path, spec, summary_of=None) -> Path:
    """A run folder with real safetensors weights and their digest; its summary is `summary_of`'s
    (another run's) when given."""
    owner = summary_of or spec
    run = results / "runs" / spec.run_id
    run.mkdir(parents=True, exist_ok=True)
    save_file(
        {"w": __import__("torch").arange(6.0)},
        str(run / "model.safetensors"),
        metadata={"run_id": spec.run_id},
    )
    summary = {
        "run_id": owner.run_id,
        "status": "ok",
        "steps": 3,
        "total_steps": 3,
        "tokens_seen": 96,
        "final_val_loss": 5.0,
        "n_params": owner.shape.n_params,
        "spec": owner.to_dict(),
        "spec_hash": owner.spec_hash(),
        WEIGHTS_DIGEST: hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest(),
    }
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 2, "train_loss": 5.5, "val_loss": 5.4}) + "\n"
    )
    return run


@pytest.fixture(scope="module")
def grid2(wiki_jsonl):
    return expand_grid(load_config(tiny_config(wiki_jsonl, learning_rates=[3e-3, 1e-2])))


def _identity_cases(a, b, results: Path):
    """(name, run folder, spec the stage is given, expected message) for each mismatch."""
    copied = _fake_run(results / "copied", b, summary_of=a)  # a's summary in b's folder
    edited = _fake_run(results / "edited", b, summary_of=a)
    s = json.loads((edited / "summary.json").read_text())
    s["run_id"] = b.run_id  # the run id edited to the folder's; the spec is still a's
    (edited / "summary.json").write_text(json.dumps(s))
    both = _fake_run(results / "both", b, summary_of=a)
    s = json.loads((both / "summary.json").read_text())
    s["run_id"] = s["spec"]["run_id"] = b.run_id  # both edited: only the grid's spec hash tells
    s["spec_hash"] = type(a).from_dict(s["spec"]).spec_hash()
    (both / "summary.json").write_text(json.dumps(s))
    good = _fake_run(results / "good", b)
    return [
        ("copied", copied, b, "belongs to run"),
        ("edited", edited, b, "records run id .* but its spec is run"),
        ("both", both, b, "grid's spec of"),
        ("other spec", good, a, "stage was given run"),
    ]


def test_every_stage_checks_the_runs_identity_before_any_work(grid2, tmp_path):
    from depthbench.evals.run import run_nll
    from depthbench.launch.local import dispatch_nll, dispatch_probes
    from depthbench.probes.run import run_probes

    a, b = grid2.runs.values()
    nowhere, out = tmp_path / "no-data", tmp_path / "out.parquet"
    for name, run_dir, spec, message in _identity_cases(a, b, tmp_path):
        for call in (
            lambda: run_probes(spec.to_dict(), str(nowhere), str(run_dir), str(out), {}),
            lambda: run_nll(spec.to_dict(), str(run_dir), str(nowhere), str(out), {}),
            lambda: dispatch_probes(
                spec, str(nowhere), str(run_dir), str(tmp_path / "w"), str(out), {}, INLINE
            ),
            lambda: dispatch_nll(
                spec, str(run_dir), str(tmp_path / "w"), str(nowhere), str(out), {}, INLINE
            ),
        ):
            with pytest.raises(DataError, match=re.escape(str(run_dir)) + ".*" + message):
                call()
    assert not out.exists() and not (tmp_path / "w").exists()


def test_export_checks_the_runs_identity_before_writing(grid2, tmp_path):
    from depthbench.hf.export import export_run

    a, b = grid2.runs.values()
    for name, run_dir, _, message in _identity_cases(a, b, tmp_path)[:2]:  # export knows no grid
        with pytest.raises(
            DataError, match=re.escape(str(run_dir / "summary.json")) + ".*" + message
        ):
            export_run(run_dir, tmp_path / "export")
    assert not (tmp_path / "export").exists()


# -- depthbench status ---------------------------------------------------------------------------
def _status(cfg: Path, res: Path, capsys) -> tuple[dict, str]:
    from depthbench.commands.cli import main

    assert main(["status", str(cfg), "--results", str(res)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()}
    return rows, out


def _status_grid(wiki_jsonl, tmp_path: Path):
    """Two runs, probes and NLL off (tests.conftest.status_grid)."""
    config = tiny_config(wiki_jsonl, learning_rates=[3e-3, 1e-2])
    config["probes"] = {"enabled": False}
    return status_grid(config, tmp_path)


def test_status_reports_corrupt_weights_with_the_forcerun_command(wiki_jsonl, tmp_path, capsys):
    cfg, exp, res = _status_grid(wiki_jsonl, tmp_path)
    a, b = exp.runs.values()
    for spec in (a, b):
        _fake_run(res, spec)
    _flip_byte(res / "runs" / a.run_id / "model.safetensors")
    rows, out = _status(cfg, res, capsys)
    weights = res / "runs" / a.run_id / "model.safetensors"
    assert rows[a.run_id][:4] == ["corrupt", "-", "-", "none:"] and rows[b.run_id][0] == "trained"
    assert (
        f"`snakemake --forcerun {weights}` trains it again" in out and f"{weights}: corrupt" in out
    )
    assert "fail on 1 run with corrupt weights" in out


def test_weights_without_a_recorded_digest_are_invalid_and_retrained(wiki_jsonl, tmp_path, capsys):
    """A summary without a digest vouches for no weights: every stage refuses the run, and
    status names it invalid with the command that trains it again."""
    cfg, exp, res = _status_grid(wiki_jsonl, tmp_path)
    a, b = exp.runs.values()
    run = _fake_run(res, a)
    _fake_run(res, b)
    s = json.loads((run / "summary.json").read_text())
    del s[WEIGHTS_DIGEST]
    (run / "summary.json").write_text(json.dumps(s))
    with pytest.raises(DataError, match=f"records no {WEIGHTS_DIGEST}"):
        check_run(run, a)
    rows, out = _status(cfg, res, capsys)
    assert rows[a.run_id][0] == "invalid" and rows[b.run_id][0] == "trained"
    assert f"`snakemake --forcerun {run / 'model.safetensors'}`" in out


def _snakemake_record(root: Path, kind: str, path: Path) -> Path:
    """The file Snakemake's own persistence names for its `kind` record about `path`."""
    from snakemake.persistence.file import FilePersistence

    folder = root / ".snakemake" / kind
    folder.mkdir(parents=True, exist_ok=True)
    persistence = FilePersistence.__new__(FilePersistence)  # only its naming, no workflow
    persistence._max_len = None
    return Path(persistence._record_path(str(folder), os.path.relpath(path, root)))


def test_status_follows_snakemakes_checksum_exception_to_the_mtime_trigger(
    wiki_jsonl, tmp_path, capsys
):
    """An input no larger than 1,000,000 bytes, newer than the outputs but with the SHA-256
    Snakemake recorded for it, redoes nothing; the same input with other bytes does. (The test of
    the workflow checks this against Snakemake itself.)"""
    cfg, exp, res = _status_grid(wiki_jsonl, tmp_path)
    a, _ = exp.runs.values()
    run = _fake_run(res, a)
    meta = res / "data" / exp.data_id / "meta.json"
    key = os.path.relpath(meta, tmp_path)
    for name in ("summary.json", "model.safetensors", "metrics.jsonl"):
        record = _snakemake_record(tmp_path, "metadata", run / name)
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(
            json.dumps(
                {
                    "input_checksums": {
                        key: "sha256:" + hashlib.sha256(meta.read_bytes()).hexdigest()
                    }
                }
            )
        )
    os.utime(meta)  # touch: newer than every output
    rows, _ = _status(cfg, res, capsys)
    assert rows[a.run_id][0] == "trained"
    meta.write_text(meta.read_text() + " ")
    rows, _ = _status(cfg, res, capsys)
    assert rows[a.run_id][0] == "stale"


def test_status_reads_snakemakes_incomplete_markers(wiki_jsonl, tmp_path, capsys):
    cfg, exp, res = _status_grid(wiki_jsonl, tmp_path)
    a, b = exp.runs.values()
    for spec in (a, b):
        _fake_run(res, spec)
    marker = _snakemake_record(
        tmp_path, "incomplete", res / "runs" / a.run_id / "model.safetensors"
    )
    marker.write_text('{"external_jobid": null}')
    rows, out = _status(cfg, res, capsys)
    assert rows[a.run_id][:2] == ["incomplete", "-"] and rows[b.run_id][0] == "trained"
    assert "`snakemake --rerun-incomplete` trains the run again" in out


def test_a_long_path_is_split_as_snakemake_splits_its_record_names(tmp_path):
    from depthbench.commands.snakemake_records import snakemake_record as record_path

    path = tmp_path / "results" / "runs" / ("x" * 300) / "summary.json"
    ours = record_path(tmp_path, "incomplete", path)
    assert ours == _snakemake_record(tmp_path, "incomplete", path)
    assert len(ours.relative_to(tmp_path / ".snakemake" / "incomplete").parts) == 2
