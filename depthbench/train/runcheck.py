"""A finished run's files, checked before any stage reads them.

Every stage that reads a trained run (probes, NLL, export, status) calls `check_run` first:

- identity: `depthbench.analysis.tables.read_summary` (the summary parses, carries its folder's
  run id, and its spec hashes to the spec hash it records and, where the caller knows the grid,
  to the grid's spec hash of that run);
- final weights: `model.safetensors` hashes (SHA-256 of the file's bytes) to the
  `weights_sha256` that training recorded in summary.json. Training computes it from the
  temporary file just before that file is renamed into place, and writes summary.json after it,
  so the digest always describes the weights published with that summary.

A summary without `weights_sha256` describes weights nothing vouches for: the run is invalid,
and training it again (`snakemake --forcerun` on its weights) makes a summary with the digest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from depthbench.util.errors import DataError, DepthBenchError
from depthbench.train.listing import file_sha256
from depthbench.spec.run import RunSpec

WEIGHTS = "model.safetensors"
WEIGHTS_DIGEST = "weights_sha256"  # the summary.json key


class CorruptWeights(DataError):
    """The final weights do not hash to the digest recorded with them."""


def recover_corrupt(run_dir: str | os.PathLike) -> str:
    """How to recover a run whose final weights are damaged or missing. Snakemake alone would not
    redo a missing or changed intermediate output while what depends on it is up to date;
    `--forcerun` on it removes the train job's outputs and runs it again, which resumes from the
    run's last checkpoint (results/work/<run id>), and then every stage after it."""
    weights = Path(run_dir) / WEIGHTS
    return (
        f"`snakemake --forcerun {weights}` "
        "(with the --configfile or --profile you run the workflow with) "
        "trains the run again, resuming from its last checkpoint"
    )


def verify_weights(run_dir: str | os.PathLike, summary: dict) -> None:
    """Checks that the weights match the recorded digest: CorruptWeights naming the file on a
    mismatch, DataError if the file is missing or the summary records no digest."""
    run_dir = Path(run_dir)
    weights = run_dir / WEIGHTS
    if not weights.is_file():
        raise DataError(
            f"{weights}: no such file (the run's final weights); {recover_corrupt(run_dir)}"
        )
    want = summary.get(WEIGHTS_DIGEST)
    if want is None:
        raise DataError(
            f"{run_dir / 'summary.json'}: records no {WEIGHTS_DIGEST}, so nothing vouches for "
            f"{weights}; {recover_corrupt(run_dir)}"
        )
    actual = file_sha256(weights)
    if actual != want:
        raise CorruptWeights(
            f"{weights}: corrupt: its SHA-256 is {actual[:16]}..., "
            f"not the {want[:16]}... recorded in "
            f"{run_dir / 'summary.json'} when it was written; {recover_corrupt(run_dir)}"
        )


def check_run(run_dir: str | os.PathLike, spec=None, weights: bool = True) -> dict:
    """The run's summary after checking its identity (against `spec`, the grid's RunSpec of this
    run, when given: its run id must be the folder's and its spec hash the summary's) and, with
    `weights`, its final weights; DataError naming the file."""

    run_dir = Path(run_dir)
    if spec is not None and spec.run_id != run_dir.name:
        raise DataError(
            f"{run_dir}: is the folder of run {run_dir.name!r}, "
            f"but the stage was given run {spec.run_id!r}"
        )
    summary = read_summary(
        run_dir / "summary.json", {spec.run_id: spec.spec_hash()} if spec is not None else None
    )
    if weights:
        verify_weights(run_dir, summary)
    return summary


class StaleSummary(DataError):
    """A self-consistent summary whose spec hash is not the grid's for its run id. The run id
    hashes the same identity, so such a summary comes from another run (copied, its run id
    edited to the folder's): Snakemake's triggers see no change, and only `--forcerun` retrains."""


SUMMARY_KEYS = ("run_id", "status", "spec", "steps", "final_val_loss", "n_params")


def read_summary(path: str | Path, expected: dict[str, str] | None = None) -> dict:
    """A run's summary.json, checked against its identity; DataError naming the file otherwise.

    The summary must parse, carry its folder's run id (in its own `run_id` and in its spec's), and
    its spec must hash (RunSpec.spec_hash)
    to the `spec_hash` it records and to `expected[run_id]`, the grid's hash of that run (the
    table rules pass it as a param). A summary written before spec_hash existed is checked
    through the hash of the spec it carries."""
    path = Path(path)
    try:
        s = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(
            f"{path}: unreadable or truncated summary ({exc}); "
            f"`snakemake --forcerun {path}` trains the run again"
        ) from None
    missing = [k for k in SUMMARY_KEYS if not isinstance(s, dict) or k not in s]
    if missing:
        raise DataError(
            f"{path}: not a run summary (missing {missing}); "
            f"`snakemake --forcerun {path}` trains the run again"
        )
    if s["run_id"] != path.parent.name:
        raise DataError(
            f"{path}: belongs to run {s['run_id']!r}, "
            f"not to its folder's run {path.parent.name!r} (copied?); "
            f"`snakemake --forcerun {path}` trains the run again"
        )
    if isinstance(s["spec"], dict) and s["spec"].get("run_id", s["run_id"]) != s["run_id"]:
        raise DataError(
            f"{path}: records run id {s['run_id']!r} "
            f"but its spec is run {s['spec']['run_id']!r} (edited?); "
            f"`snakemake --forcerun {path}` trains the run again"
        )
    try:
        actual = RunSpec.from_dict(s["spec"]).spec_hash()
    except (DepthBenchError, KeyError, TypeError, ValueError) as exc:
        raise DataError(
            f"{path}: its spec is not a valid run spec ({exc}); "
            f"`snakemake --forcerun {path}` trains the run again"
        ) from None
    if s.get("spec_hash", actual) != actual:
        raise DataError(
            f"{path}: records spec hash {s['spec_hash']} "
            f"but its spec hashes to {actual} (edited?); "
            f"`snakemake --forcerun {path}` trains the run again"
        )
    want = (expected or {}).get(s["run_id"], actual)
    if want != actual:
        raise StaleSummary(
            f"{path}: written for spec {actual}, but the grid's spec of {s['run_id']} is {want} "
            f"(copied from another run?); `snakemake --forcerun {path}` trains the run again"
        )
    return s
