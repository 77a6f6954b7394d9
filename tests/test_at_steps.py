"""Probes over training (probes.at_steps): step choice, snapshots at exactly those steps, exact
resumption, the at-step probe of the final step against the final model's, the figures."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from depthbench.config import load_config
from depthbench.errors import ConfigError
from depthbench.train.checkpoint import checkpoint_path, checksum_path, list_checkpoints
from depthbench.train.loop import RunPaths, train
from depthbench.train.snapshots import list_snapshots, resolve_steps, run_folder, work_folder
from tests.conftest import tiny_config


def _spec(exp, steps: int, snapshot_steps, **train_kw):
    (spec,) = exp.runs.values()
    spec = copy.deepcopy(spec)
    spec.train.total_steps = steps
    spec.train.snapshot_steps = list(snapshot_steps)
    for k, v in train_kw.items():
        setattr(spec.train, k, v)
    return spec


# -- step choice --------------------------------------------------------------------------------
def test_log_spaced_steps_are_geometric_and_end_at_the_final_step():
    steps = resolve_steps({"log_spaced": 5}, 10_000)
    assert steps == [1, 10, 100, 1000, 10_000]  # 10_000^(k/4), k = 0..4
    assert resolve_steps({"log_spaced": 6}, 200) == [1, 3, 8, 24, 69, 200]
    assert resolve_steps({"log_spaced": 8}, 4) == [1, 2, 3, 4]  # rounding merges neighbours
    assert resolve_steps({"log_spaced": 1}, 37) == [37]
    assert resolve_steps([], 50) == [] and resolve_steps(None, 50) == []


def test_listed_steps_keep_the_final_step_and_drop_steps_past_the_run():
    assert resolve_steps([20, 5, 500], 100) == [5, 20, 100]
    assert resolve_steps([100], 100) == [100]


@pytest.mark.parametrize("bad", [[0, 5], [2.5], {"log_spaced": 0}, {"linear": 3}, "log"])
def test_bad_at_steps_names_the_field(bad):
    with pytest.raises(ConfigError, match=r"probes\.at_steps"):
        resolve_steps(bad, 100)


@pytest.mark.parametrize("bad", [[0, 5], [3, 3], {"log_spaced": 0}, {"log_spaced": 4, "extra": 1}, "log"])
def test_schema_refuses_bad_at_steps(wiki_jsonl, bad):
    config = tiny_config(wiki_jsonl, probes={"at_steps": bad})
    with pytest.raises(ConfigError, match=r"probes\.at_steps"):
        load_config(config)


def test_schema_accepts_both_forms_and_defaults_to_off(wiki_jsonl):
    assert load_config(tiny_config(wiki_jsonl))["probes"]["at_steps"] == []
    for good in ([1, 10, 40], {"log_spaced": 6}):
        assert load_config(tiny_config(wiki_jsonl, probes={"at_steps": good}))["probes"]["at_steps"] == good


# -- snapshots during training -------------------------------------------------------------------
def test_snapshots_are_written_at_exactly_the_configured_steps(tiny_data, tmp_path):
    _, exp, shards = tiny_data
    spec = _spec(exp, 12, [1, 3, 7, 12], checkpoint_every=100)
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    summary = train(spec, shards, paths, progress=False)
    assert summary["status"] == "ok"
    published = list_snapshots(run_folder(paths))
    assert [s for s, _ in published] == [1, 3, 7, 12]
    assert sorted(p.name for p in run_folder(paths).iterdir()) == [p.name for _, p in published]  # nothing else
    final = load_file(paths.weights)
    last = load_file(published[-1][1])
    assert set(last) == set(final) and all(torch.equal(last[k], final[k]) for k in final)
    early = load_file(published[0][1])  # one update away from init: not the final weights
    assert not all(torch.equal(early[k], final[k]) for k in final)


def _snapshot_bytes(paths) -> dict[int, bytes]:
    return {s: p.read_bytes() for s, p in list_snapshots(run_folder(paths))}


def test_resumed_run_writes_the_same_snapshots_as_an_uninterrupted_run(tiny_data, tmp_path):
    _, exp, shards = tiny_data
    spec = _spec(exp, 12, [2, 5, 6, 9, 12], checkpoint_every=4)
    full = RunPaths(tmp_path / "full", tmp_path / "full_work")
    train(spec, shards, full, progress=False)
    expected = _snapshot_bytes(full)
    assert sorted(expected) == [2, 5, 6, 9, 12]

    part = RunPaths(tmp_path / "part", tmp_path / "part_work")
    assert train(spec, shards, part, progress=False, stop_after=7)["status"] == "interrupted"
    assert [s for s, _ in list_checkpoints(part.checkpoints)] == [4, 7]
    assert [s for s, _ in list_snapshots(work_folder(part))] == [2, 5, 6]
    # A kill after snapshot 6 but before checkpoint 7 was complete: the run resumes at step 4 and
    # redoes steps 5..7, whose snapshots must end up written once, as before.
    checksum_path(checkpoint_path(part.checkpoints, 7)).unlink()
    (work_folder(part) / "step_00000006.safetensors").write_bytes(b"partial garbage")
    train(spec, shards, part, progress=False)
    assert _snapshot_bytes(part) == expected


def test_resume_from_a_checkpoint_without_the_earlier_snapshots_trains_again(tiny_data, tmp_path):
    """at_steps switched on after a run was checkpointed: its early snapshots can only come from
    training again, which ends with the uninterrupted run's snapshots and weights."""
    _, exp, shards = tiny_data
    spec = _spec(exp, 10, [1, 4, 10], checkpoint_every=100)
    full = RunPaths(tmp_path / "full", tmp_path / "full_work")
    train(spec, shards, full, progress=False)
    part = RunPaths(tmp_path / "part", tmp_path / "part_work")
    train(_spec(exp, 10, []), shards, part, progress=False, stop_after=6)  # no snapshots kept
    train(spec, shards, part, progress=False)
    assert _snapshot_bytes(part) == _snapshot_bytes(full)
    a, b = load_file(full.weights), load_file(part.weights)
    assert all(torch.equal(a[k], b[k]) for k in a)
