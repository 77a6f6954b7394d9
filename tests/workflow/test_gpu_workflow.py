"""scripts/gpu_workflow.sh as a GPU session runs it, on the CPU at a tiny size: `prepare` in one
copy of the workflow, `run --device cpu --cores 2` in another whose code is newer than the
prepared outputs (as a checkout copied onto the GPU machine is). The prepared tokenizer, shards
and NLL sets must be taken as up to date there (no job of theirs runs again), every other stage
must run, and the record, headline figure and report must be left in the output folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import tiny_config
from tests.workflow_runs import copy_workflow, job_counts

pytestmark = pytest.mark.slow

PREPARED_RULES = {"tokenizer", "tokenize", "nll_sets"}
MODEL_STAGES = {"train", "probe", "nll", "removal"}


def script(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_workflow.sh"), *args],
        cwd=root,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"gpu_workflow.sh {args}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def fresh_checkout(dest: Path) -> Path:
    """A copy of the workflow whose code files are as new as now, like a checkout copied onto
    another machine after the bundle was made."""
    root = copy_workflow(dest)
    now = time.time()
    for path in [
        root / "Snakefile",
        *(root / "workflow").rglob("*"),
        *(root / "scripts").rglob("*"),
    ]:
        os.utime(path, (now, now))
    return root


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory, wiki_jsonl):
    """(config path, bundle, the run's checkout, its output folder, the run's stdout)."""
    base = tmp_path_factory.mktemp("gpu_script")
    config = tiny_config(wiki_jsonl, name="tiny_gpu_script")
    config["tokenizer"] = {"kind": "bpe", "vocab_size": 384}
    config["train"].update(tokens_per_param=0.4, checkpoint_every=1000, dynamics_every=10)
    config["nll"] = {"sets": ["humaneval", "gsm8k"], "max_docs_per_set": 6}
    path = base / "tiny.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    (base / "prep").mkdir()
    prep = copy_workflow(base / "prep")
    script(prep, "prepare", str(path), str(base / "bundle"))
    (base / "gpu").mkdir()
    gpu = fresh_checkout(base / "gpu")
    out = base / "out"
    args = ["--config", str(path), "--bundle", str(base / "bundle"), "--out", str(out)]
    done = script(gpu, "run", *args, "--device", "cpu", "--cores", "2")
    return path, base / "bundle", gpu, out, done.stdout + done.stderr


def test_the_prepared_outputs_are_up_to_date_after_the_copy(gpu_run):
    _, bundle, gpu, _, log = gpu_run
    assert "the prepared tokenizer, shards and NLL sets are up to date" in log
    planned = job_counts(log.split("Building DAG of jobs", 2)[-1])  # the real run's first plan
    assert planned["train"] == 1 and not PREPARED_RULES & set(planned), planned
    assert not re.search(r"^(?:local)?rule (tokenizer|tokenize|nll_sets):", log, re.M)
    with tarfile.open(bundle / "prepared.tar.gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
        for name in ("tokenizers", "data", "evals"):
            (prepared,) = [n for n in members if n.startswith(f"results/{name}/")][:1]
            assert tar.extractfile(members[prepared]).read() == (gpu / prepared).read_bytes()
    # Snakemake's records of them came along: their params and code are compared, not skipped
    assert len([n for n in members if n.startswith(".snakemake/metadata/")]) == 3


def test_a_plain_copy_of_the_prepared_outputs_would_be_redone(gpu_run, tmp_path):
    """Extracted with the times they were made, the outputs are older than the copied scripts:
    Snakemake would redo them (and fail there without the corpus and evaluation packages). This is
    what `gpu_bundle unpack` prevents."""
    config, bundle, *_ = gpu_run
    root = fresh_checkout(tmp_path)
    with tarfile.open(bundle / "prepared.tar.gz") as tar:
        tar.extractall(root, filter="data")
    dry = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(config)]
        + ["--until", "tokenize", "nll_sets"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert PREPARED_RULES <= set(job_counts(dry.stdout + dry.stderr)), dry.stdout[-3000:]


def test_the_run_leaves_its_record_figure_and_report(gpu_run):
    *_, out, log = gpu_run
    assert sorted(p.name for p in out.iterdir()) == [
        "headline.png",
        "record.json",
        "report.html",
        "results.tar.gz",
        "snakemake.log",
    ]
    assert (out / "headline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<figure" in (out / "report.html").read_text()
    record = json.loads((out / "record.json").read_text())
    assert record["config"] == "tiny_gpu_script" and record["missing"] == []
    assert record["devices"] == {stage: ["cpu"] for stage in sorted(MODEL_STAGES)}
    jobs = {(j["rule"], j["target"]): j for j in record["jobs"]}
    ran = {rule for rule, _ in jobs}
    assert MODEL_STAGES | {"tables", "figures", "claims", "report"} <= ran
    assert all(j["seconds"] >= 0 for j in jobs.values())
    assert {j["rule"] for j in jobs.values() if j["prepared_elsewhere"]} == PREPARED_RULES
    (run,) = record["runs"]
    assert run["device"] == "cpu" and run["dtype"] == "float32" and run["status"] == "ok"
    assert run["compile"] == "none"
    assert run["final_val_loss"] < run["unigram_floor"] and run["tokens_per_s"] > 0
    assert len(record["claims"]) >= 12 and all(c["verdict"] for c in record["claims"])
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    assert "results/tables/claims.parquet" in names and "results/figures/headline.png" in names
    assert not [n for n in names if n.endswith((".bin", ".safetensors", ".pt"))]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")
def test_run_on_cuda_without_a_gpu_stops_before_any_job(gpu_run, tmp_path):
    config, *_ = gpu_run
    root = fresh_checkout(tmp_path)
    done = script(root, "run", "--config", str(config), "--out", "out", check=False)
    assert done.returncode != 0 and "torch sees no CUDA device" in done.stderr
    assert not (root / "results").exists()
