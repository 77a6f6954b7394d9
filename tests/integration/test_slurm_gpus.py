"""A SLURM request for GPUs on a cluster whose nodes have no GPU gres is named by the dispatcher
before sbatch sees it (depthbench.launch.slurm.check_gpus), against a stand-in `sinfo` on PATH."""

from __future__ import annotations

import os
import stat

import pytest

from depthbench.util.errors import ConfigError
from depthbench.launch.slurm import check_gpus

SLURM = {"backend": "slurm", "slurm": {"gpus_per_node": 1}}


def _sinfo(tmp_path, monkeypatch, gres: str) -> None:
    """A `sinfo` that prints `gres` one node line each, and records its arguments."""
    script = tmp_path / "bin" / "sinfo"
    script.parent.mkdir()
    script.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\nprintf '{gres}'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")


def test_gpus_on_a_cluster_without_gpu_gres_are_refused_before_submission(
    tiny_data, tmp_path, monkeypatch
):
    import depthbench.launch.local as launch

    _, exp, data_dir = tiny_data
    _sinfo(tmp_path, monkeypatch, "(null)\\n")
    monkeypatch.setattr(launch, "submit_and_wait", lambda *a, **k: pytest.fail("submitted"))
    spec = next(iter(exp.runs.values()))
    with pytest.raises(
        ConfigError,
        match=r"'launcher\.slurm\.gpus_per_node': 1 GPUs per node requested.*no GPU gres "
        r"\(sinfo: \(null\)\); for CPU runs set gpus_per_node: 0",
    ):
        launch.dispatch(spec, str(data_dir), str(tmp_path / "run"), str(tmp_path / "work"), SLURM)


def test_gpu_gres_or_no_gpus_or_no_slurm_pass(tmp_path, monkeypatch):
    _sinfo(tmp_path, monkeypatch, "(null)\\ngpu:h100:8(S:0-1),shard:2\\n")
    check_gpus(SLURM)
    check_gpus({"backend": "slurm", "slurm": {"gpus_per_node": 0}})
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sinfo: nothing to ask
    check_gpus(SLURM)


def test_the_partition_asked_is_the_configured_one(tmp_path, monkeypatch):
    _sinfo(tmp_path, monkeypatch, "(null)\\n")
    with pytest.raises(ConfigError, match="partition 'debug'"):
        check_gpus({"backend": "slurm", "slurm": {"gpus_per_node": 2, "partition": "debug"}})
    assert (tmp_path / "args").read_text().split() == ["-h", "-o", "%G", "-p", "debug"]
