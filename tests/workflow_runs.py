"""Running the workflow as a user does, in a copy of the repository: shared by the end-to-end
tests, with the corpus split into local files that the tokenization-in-pieces tests read, in the
workflow and in process."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from tests.conftest import REPO, tiny_config

SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def snakemake(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*SNAKEMAKE, "--cores", "2", *args], cwd=cwd, capture_output=True, text=True, timeout=900
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def dry_run_in(directory: Path, *args: str) -> subprocess.CompletedProcess:
    """`snakemake -n` of the repository's Snakefile with `directory` as the working directory
    (its config/ and results/, not the checkout's); not checked, the caller reads the result."""
    return subprocess.run(
        [*SNAKEMAKE, "-n", "--cores", "1", "--snakefile", str(REPO / "Snakefile")]
        + ["--directory", str(directory), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table of a Snakemake (dry) run."""
    counts: dict[str, int] = {}
    if "Job stats:" not in output:
        return counts
    table = output.split("Job stats:", 1)[1]
    for line in table.splitlines()[3:]:
        m = re.fullmatch(r"(\w+)\s+(\d+)", line.strip())
        if not m:
            break
        counts[m.group(1)] = int(m.group(2))
    return counts


def copy_workflow(dest: Path) -> Path:
    for name in (
        "Snakefile",
        "workflow",
        "scripts",
        "config",
        "slurm",
        "envs",
    ):  # envs: the rules' conda: files
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / name)
    return dest


def write_config(root: Path, config: dict) -> None:
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def split_corpus(wiki_jsonl: Path, root: Path, n_files: int) -> list[str]:
    """The documents of `wiki_jsonl` in `n_files` local JSONL files under `root`, in order; their
    paths."""
    lines = wiki_jsonl.read_text().splitlines(keepends=True)
    step = -(-len(lines) // n_files)
    paths = []
    for k in range(n_files):
        path = root / f"part{k:02d}.jsonl"
        path.write_text("".join(lines[k * step : (k + 1) * step]))
        paths.append(str(path))
    return paths


def grid(wiki_jsonl, **overrides) -> dict:
    config = tiny_config(
        wiki_jsonl,
        architectures=["pre_ln", "post_ln"],
        shapes=[{"n_layer": 1}, {"n_layer": 2}],
        learning_rates=[3e-3, 50.0],  # 50.0 diverges
    )
    config["tokenizer"] = {"kind": "bpe", "vocab_size": 384}
    # about 155 steps: every run at 3e-3 ends 0.3 nats or more below the threshold that
    # test_workflow holds it to (0.3 under the unigram floor)
    config["train"]["tokens_per_param"] = 0.4
    config["train"]["dynamics_every"] = 20
    # three checkpoints a run instead of 38 (about 50 ms each): these runs are never resumed, and
    # the tests that resume use their own grids
    config["train"]["checkpoint_every"] = 50
    config["nll"] = {"sets": ["humaneval", "sciq", "gsm8k"], "max_docs_per_set": 6}
    config.update(overrides)
    return config


@contextlib.contextmanager
def edited_config(root: Path, config: dict) -> Iterator[None]:
    """The workflow copy's config/config.yaml replaced by `config` for the block, and put back
    whatever happens in it: a failing test leaves the shared copy as the next test expects it."""
    path = root / "config" / "config.yaml"
    original = path.read_bytes()
    write_config(root, config)
    try:
        yield
    finally:
        path.write_bytes(original)
