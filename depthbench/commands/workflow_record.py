"""The record of one workflow run, read from its results/ folder after Snakemake has finished (or
failed): what ran, where and how long, in one JSON file that can be committed
(benchmarks/records/). scripts/gpu_workflow.sh writes it at the end of every run.

- `jobs`: one entry per Snakemake job that ran, from its `benchmark:` file (results/benchmarks/
  <rule>/<target>.tsv, or results/benchmarks/<rule>.tsv for a job of no wildcard): wall seconds,
  peak resident memory (MB), and for the jobs that touch a model (train, probe, nll, removal)
  the device it ran on: training's from the run's summary.json, the others' from the report each
  job adds to its record in the run's work folder (depthbench.launch.local); `prepared_elsewhere`
  marks the jobs whose outputs came with the bundle (--prepared: they ran on the CPU machine that
  prepared it, and their times are that machine's).
- `runs`: per run of runs.parquet, its status, final validation loss, unigram floor, whether it
  learned, tokens/s, wall seconds, the device and the dtype it trained in, and its compile and
  kernels settings (scripts/gpu_workflow.sh trains a run whose training failed again with
  neither).
- `devices`: per stage, the devices its jobs ran on (one entry when every job of the stage ran
  on the same device), which is how a reader checks that no stage fell back to the CPU.
- `claims`: claims.parquet's verdicts with the numbers compared.

Written atomically; a table or file that is missing (a failed run) leaves its part empty and is
named under `missing`, so the record of a failed run still says how far it got.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

STAGES = {"probe": "probe_job.json", "nll": "nll_job.json", "removal": "removal_job.json"}
CLAIM_COLUMNS = ["claim_id", "verdict", "ours", "paper", "scale", "single_seed"]


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _finite(value):
    """JSON has no NaN: None in its place."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _device(results: Path, rule: str, target: str) -> str | None:
    if rule == "train":
        summary = _json(results / "runs" / target / "summary.json") or {}
        return summary.get("device")
    if rule in STAGES:
        record = _json(results / "work" / target / STAGES[rule]) or {}
        return (record.get("result") or {}).get("device")
    return None


def job_times(results: Path) -> list[dict]:
    """Every job's benchmark record, in rule then target order."""
    jobs = []
    for tsv in sorted((results / "benchmarks").rglob("*.tsv")):
        parts = tsv.relative_to(results / "benchmarks").with_suffix("").parts
        rule, target = (parts[0], "/".join(parts[1:])) if len(parts) > 1 else (parts[0], "")
        with tsv.open(newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        if not rows:
            continue
        jobs.append(
            {
                "rule": rule,
                "target": target,
                "seconds": float(rows[-1]["s"]),
                "max_rss_mb": _finite(float(rows[-1].get("max_rss") or "nan")),
                "device": _device(results, rule, target),
            }
        )
    return jobs


def stage_devices(jobs: list[dict]) -> dict[str, list[str]]:
    out: dict[str, set[str]] = {}
    for job in jobs:
        if job["rule"] == "train" or job["rule"] in STAGES:
            out.setdefault(job["rule"], set()).add(job["device"] or "unknown")
    return {rule: sorted(devices) for rule, devices in sorted(out.items())}


def run_rows(results: Path, missing: list[str]) -> list[dict]:
    import pandas as pd

    path = results / "tables" / "runs.parquet"
    if not path.exists():
        missing.append(str(path))
        return []
    runs = pd.read_parquet(path)
    columns = ["run_id", "arch", "n_layer", "d_model", "lr", "seed", "status", "final_val_loss"]
    columns += ["unigram_floor", "learned", "tokens_per_s", "wall_seconds", "params"]
    out = []
    for row in runs[[c for c in columns if c in runs.columns]].to_dict("records"):
        summary = _json(results / "runs" / row["run_id"] / "summary.json") or {}
        device = summary.get("device")
        train = (summary.get("spec") or {}).get("train") or {}
        dtype = train.get("dtype", "auto")
        if dtype == "auto" and device:  # depthbench.train.recipe.resolve_dtype
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        out.append(
            {k: _finite(v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            | {"device": device, "dtype": dtype}
            | {"compile": train.get("compile"), "kernels": train.get("kernels")}
        )
    return out


def claim_rows(results: Path, missing: list[str]) -> list[dict]:
    import pandas as pd

    path = results / "tables" / "claims.parquet"
    if not path.exists():
        missing.append(str(path))
        return []
    claims = pd.read_parquet(path)
    keep = [c for c in CLAIM_COLUMNS if c in claims.columns]
    return [
        {k: _finite(v.item() if hasattr(v, "item") else v) for k, v in row.items()}
        for row in claims[keep].to_dict("records")
    ]


def build(results: Path, name: str, command: str, environment: dict | None = None) -> dict:
    missing: list[str] = []
    jobs = job_times(results)
    return {
        "config": name,
        "command": command,
        "environment": environment or {},
        "total_job_seconds": round(sum(j["seconds"] for j in jobs), 2),
        "devices": stage_devices(jobs),
        "jobs": jobs,
        "runs": run_rows(results, missing),
        "claims": claim_rows(results, missing),
        "missing": missing,
    }


def environment() -> dict:
    """Python, torch and the accelerator this process sees."""
    import platform

    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    from depthbench.util.io import atomic_write_json

    parser = argparse.ArgumentParser(prog="python -m depthbench.commands.workflow_record")
    parser.add_argument("results", type=Path, help="the workflow's results folder")
    parser.add_argument("out", type=Path, help="the record (JSON) to write")
    parser.add_argument("--name", default="", help="the config's name")
    parser.add_argument("--command", default="", help="the command that ran the workflow")
    parser.add_argument("--wall-seconds", type=float, default=None)
    parser.add_argument(
        "--prepared",
        default="",
        help="comma-separated rules whose jobs ran where the bundle was prepared (not here)",
    )
    args = parser.parse_args(argv)
    record = build(args.results, args.name, args.command, environment())
    prepared = {r for r in args.prepared.split(",") if r}
    for job in record["jobs"]:
        job["prepared_elsewhere"] = job["rule"] in prepared
    record["wall_seconds"] = args.wall_seconds
    atomic_write_json(args.out, record)
    print(f"{args.out}: {len(record['jobs'])} jobs, devices {record['devices']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
