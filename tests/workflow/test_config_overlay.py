"""A config overlay on the default config, given to Snakemake after config/config.yaml as a second
--configfile: Snakemake merges the two mappings, and the plan holds the runs of the overlay's
architectures only, whatever other architectures the default's per-architecture settings name."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO
from tests.workflow_runs import dry_run_in


@pytest.mark.slow
def test_an_overlay_narrows_the_default_grid(tmp_path):
    """`snakemake -n --configfile config/config.yaml subset.yaml` with architectures [pre_ln, hc]:
    Snakemake merges mappings, so the default's learning_rates_by_arch keys for the other
    architectures stay in the merged config; it plans pre_ln's and hc's runs only."""
    subset = tmp_path / "subset.yaml"
    subset.write_text("architectures: [pre_ln, hc]\n")
    work = tmp_path / "work"  # an empty results/ whatever the checkout's holds
    work.mkdir()
    (work / "config").symlink_to(REPO / "config")  # config/ for the claims file
    done = dry_run_in(work, "--configfile", str(REPO / "config/config.yaml"), str(subset))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout + done.stderr
    trained = set(re.findall(r"wildcards: run_id=([A-Za-z0-9_.+-]+)", text))
    train_jobs = re.search(r"^train\s+(\d+)$", text, re.M)
    assert train_jobs, text[-3000:]
    assert int(train_jobs.group(1)) == 18  # 3 learning rates x 3 shapes, each (replicates later)
    assert trained and {r.split("_L")[0] for r in trained} <= {"pre_ln", "hc"}
