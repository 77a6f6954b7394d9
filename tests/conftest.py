"""Shared fixtures: a small real corpus (offline Wikipedia summaries) and its token shards."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

import pytest

# depthbench.grid.config, .data.corpus and .data.prepare are imported inside the fixtures: they need
# optional packages (jsonschema, tokenizers, the corpus) that a bare GPU machine may lack, where
# tests/integration/test_gpu.py must still collect and skip what it cannot run.

REPO = Path(__file__).resolve().parents[1]

# The suite runs on 2 workers (pytest-xdist, `--dist loadscope` in pyproject.toml: a module's
# tests share one worker, so its module-scoped fixtures are built once). The workers take the
# modules in collection order, so the longest go first, by their measured time on 2 cores
# (test_workflow about 2.3 minutes, test_slurm 2.5, most of it waiting for the SLURM queue,
# test_recovery_advice 1.4, the rest under 1.2): a long module collected last leaves one core
# idle while it runs alone at the end.
LONGEST_FIRST = [
    "test_workflow.py",
    "test_slurm.py",
    "test_recovery_advice.py",
    "test_distributed.py",
    "test_memory.py",
    "test_at_steps.py",
    "test_gpu_workflow.py",
    "test_workflow_plans.py",
    "test_pretrained_stages.py",
    "test_distributed_memory.py",
    "test_parallelize.py",
    "test_kernel_processes.py",
    "test_checkpoint_kill.py",
    "test_parallelize_ranks.py",
    "test_owner.py",
    "test_train.py",
    "test_launch.py",
    "test_analysis.py",
    "test_job_imports.py",
    "test_rehearse.py",
    "test_tokenize_jobs.py",
    "test_guide_commands.py",
    "test_requeue.py",
    "test_benchmarks.py",
    "test_tokenize_ranges.py",
    "test_ddp_unused_params.py",
    "test_budget.py",
    "test_claims.py",
    "test_safetensors_processes.py",
    "test_config_overlay.py",
    "test_config.py",
    "test_cpu_kernels.py",
    "test_hc_kernel.py",
]


# Tests by kind, a folder each: unit/ (in-process), workflow/ (Snakemake on a copy of the
# repository), integration/ (subprocesses, ranks, SLURM, GPU). Each folder's tests carry its
# name as a marker, so `-m unit` or `pytest tests/unit` runs one kind.
KINDS = ("unit", "workflow", "integration")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: rank.get(item.path.name, len(rank))
    )  # stable: the rest keep their order
    for item in items:
        kind = item.path.parent.name
        if kind in KINDS:
            item.add_marker(kind)


def pytest_configure(config):
    # One worker per core: each worker's torch uses its share of the cores (torch would start
    # one thread per core in every worker, and OpenMP threads spin when oversubscribed).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    try:
        import torch
    except ImportError:
        return
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    # Triton kernels (depthbench.kernels.triton_streams) are tested on CPU tensors in Triton's
    # interpreter, which triton reads from the environment when it is first imported: on for
    # every worker of a machine without a GPU (with one, the kernels run on it)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def subprocesses_only_in_slow_tests(request, monkeypatch):
    """`-m "not slow"` is the quick loop and `-m unit` the in-process tests: a test that starts a
    Python interpreter or Snakemake (a fresh process importing torch, a workflow, a rank spawned
    by multiprocessing) must be marked slow and live outside tests/unit, or it fails here naming
    the command. Short system commands that the code under test runs itself (ninja checking the
    CPU kernels' build, `sinfo` for the SLURM partitions, ctypes' `ldconfig -p`, ruff) are
    allowed. Module- and session-scoped fixtures are set up before this one and are not
    checked."""
    in_unit = request.node.get_closest_marker("unit") is not None  # its folder (KINDS)
    if request.node.get_closest_marker("slow") is not None and not in_unit:
        yield
        return
    import subprocess

    start = subprocess.Popen.__init__
    rule = (
        "is in tests/unit, whose tests run in-process (move it to tests/integration or "
        "tests/workflow)"
        if in_unit
        else "is not marked @pytest.mark.slow"
    )

    def guarded(self, args, *rest, **kwargs):
        program = os.path.basename(str(args.split()[0] if isinstance(args, str) else args[0]))
        if program.startswith(("python", "snakemake")) or program == os.path.basename(
            sys.executable
        ):
            raise AssertionError(
                f"{request.node.nodeid} starts {program} ({args!r:.200}) but {rule}"
            )
        start(self, args, *rest, **kwargs)

    def spawned(path, args, passfds):  # multiprocessing's spawn: ranks, workers
        raise AssertionError(f"{request.node.nodeid} spawns {path} ({args!r:.200}) but {rule}")

    import multiprocessing.util

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)  # monkeypatch puts them back
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawned)
    yield


@pytest.fixture(scope="session")
def wiki_jsonl(tmp_path_factory) -> Path:
    """400 real documents written as a local JSONL corpus."""
    from depthbench.data.corpus import iter_documents

    path = tmp_path_factory.mktemp("corpus") / "wiki.jsonl"
    docs = itertools.islice(iter_documents({"source": "wiki_offline", "language": "en-us"}), 400)
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def tiny_config(corpus_path: Path, **overrides) -> dict:
    config = {
        "name": "tiny",
        "corpus": {
            "name": "tiny",
            "source": "local",
            "path": str(corpus_path),
            "val_fraction": 0.1,
        },
        "tokenizer": {"kind": "bpe", "vocab_size": 512},
        # A loose tolerance: at 1e5 parameters a 16-multiple of d_model cannot meet 1% at every
        # depth these smoke tests use; the budget itself is tested in test_budget.py.
        "budget": {"params": 1.0e5, "d_model_multiple": 16, "d_ff_multiple": 16, "tolerance": 0.5},
        "shapes": [{"n_layer": 2}],
        "architectures": ["pre_ln"],
        "learning_rates": [3e-3],
        # no LR sweep extensions: the tests' grids are about other things (test_lr_extension runs
        # them, test_lr_rounds decides them)
        "lr_sweep": {"max_extensions": 0},
        "model": {"n_head": 2},
        # a few documents per NLL set: the NLL and removal stages read them, and tokenizing all
        # 12,308 of the seven sets takes 25 s, in every workflow run of the suite
        "nll": {"max_docs_per_set": 8},
        "train": {
            "seq_len": 32,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "tokens_per_param": 0.05,
            "eval_every": 5,
            "eval_batches": 2,
            "checkpoint_every": 4,
            "log_every": 2,
            "threads": 1,
        },
    }
    for key, value in overrides.items():
        config[key] = value
    return config


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, wiki_jsonl):
    """(config, experiment, data_dir) with tokenizer and shards built once for the session."""
    return tiny_data_in(tmp_path_factory.mktemp("data"), tiny_config(wiki_jsonl))


def tiny_data_in(root: Path, config: dict):
    """(config, experiment, data_dir) of `config` (a tiny_config), its tokenizer and shards built
    under `root`."""
    from depthbench.grid.config import expand_grid
    from depthbench.spec.schema import load_config
    from depthbench.data.prepare import build_shards, build_tokenizer

    config = load_config(config)
    exp = expand_grid(config)
    tok = root / "tokenizer.json"
    build_tokenizer(config, str(tok))
    build_shards(config, str(tok), str(root / "shards"), exp.data_id, exp.tokenizer_id)
    return config, exp, root / "shards"


def wait_until_gone(pid: int, seconds: float = 30.0) -> bool:
    """True once process `pid` has exited (polled), False if it still runs after `seconds`.

    An exited process whose parent has not reaped it yet (a zombie: its dispatcher was killed
    and the container's init may reap late) has exited too. The wait is generous because a
    cancelled training job may be in the middle of writing a checkpoint."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = ""
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def status_grid(config: dict, tmp_path: Path):
    """(config file, experiment, results folder) for `depthbench status`: NLL off, and the shards'
    meta.json written at an old mtime so that the summaries written after it are current."""
    import yaml

    from depthbench.grid.config import expand_grid
    from depthbench.spec.schema import load_config
    from depthbench.data.shards import META_VERSION

    config["nll"] = {**config.get("nll", {}), "enabled": False}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    exp = expand_grid(load_config(cfg))
    res = tmp_path / "results"
    meta = res / "data" / exp.data_id / "meta.json"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"version": META_VERSION}))
    os.utime(meta, (1e9, 1e9))
    return cfg, exp, res
