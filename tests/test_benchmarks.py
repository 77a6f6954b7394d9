"""The prepared GPU check runs end to end (tiny sizes on CPU) and writes every field it promises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_gpu_check_script_smoke(tmp_path):
    out = tmp_path / "gpu_check.json"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--skip-tests", "--out", str(out)],
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["pre_ln_widest"]["tokens_per_s"] > 0 and report["pre_ln_deepest"]["n_layer"] == 4
    assert set(report["arch_ratios_deepest"]) == {"post_ln", "peri_ln", "lns", "deepnorm", "keel", "hc", "mhc", "attnres_full", "attnres_block", "moda"}
    assert all("step_time_vs_pre_ln" in r for r in report["arch_ratios_deepest"].values())
