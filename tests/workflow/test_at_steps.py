"""Probes over training (probes.at_steps): step choice, snapshots at exactly those steps, exact
resumption, the at-step probe of the final step against the final model's, the figures."""

from __future__ import annotations

import copy
import os
import stat

import numpy as np
import pandas as pd

import pytest
import torch
from safetensors.torch import load_file

from depthbench.spec.schema import load_config
from depthbench.util.errors import ConfigError, DataError
from depthbench.train.checkpoint_folder import checkpoint_path, checksum_path, list_checkpoints
from depthbench.train.recipe import RunPaths
from depthbench.train.loop import train
from depthbench.train.snapshots import (
    list_snapshots,
    resolve_steps,
    run_folder,
    snapshot_path,
    work_folder,
)
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


@pytest.mark.parametrize(
    "bad", [[0, 5], [3, 3], {"log_spaced": 0}, {"log_spaced": 4, "extra": 1}, "log"]
)
def test_schema_refuses_bad_at_steps(wiki_jsonl, bad):
    config = tiny_config(wiki_jsonl, probes={"at_steps": bad})
    with pytest.raises(ConfigError, match=r"probes\.at_steps"):
        load_config(config)


def test_schema_accepts_both_forms_and_defaults_to_off(wiki_jsonl):
    assert load_config(tiny_config(wiki_jsonl))["probes"]["at_steps"] == []
    for good in ([1, 10, 40], {"log_spaced": 6}):
        assert (
            load_config(tiny_config(wiki_jsonl, probes={"at_steps": good}))["probes"]["at_steps"]
            == good
        )


# -- snapshots during training -------------------------------------------------------------------
def test_snapshots_are_written_at_exactly_the_configured_steps(tiny_data, tmp_path):
    _, exp, shards = tiny_data
    spec = _spec(exp, 12, [1, 3, 7, 12], checkpoint_every=100)
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    summary = train(spec, shards, paths, progress=False)
    assert summary["status"] == "ok"
    published = list_snapshots(run_folder(paths))
    assert [s for s, _ in published] == [1, 3, 7, 12]
    assert sorted(p.name for p in run_folder(paths).iterdir()) == [
        p.name for _, p in published
    ]  # nothing else
    umask = os.umask(0o022)
    os.umask(umask)
    assert {stat.S_IMODE(p.stat().st_mode) for _, p in published} == {
        0o666 & ~umask
    }  # readable like any result
    final = load_file(paths.weights)
    last = load_file(published[-1][1])
    assert set(last) == set(final) and all(torch.equal(last[k], final[k]) for k in final)
    early = load_file(published[0][1])  # one update away from init: not the final weights
    assert not all(torch.equal(early[k], final[k]) for k in final)


@pytest.mark.parametrize("arch", ["hc", "attnres_block"])
def test_snapshots_of_multi_stream_and_aggregating_models_load_back(tiny_data, tmp_path, arch):
    """Architectures with extra state (HC streams' static weights, AttnRes pseudo-queries): the
    snapshot holds every parameter, loads into a fresh model and the last equals the final one."""
    from depthbench.grid.config import expand_grid
    from depthbench.probes.steps import load_snapshot

    config, _, shards = tiny_data
    (spec,) = expand_grid(load_config({**config, "architectures": [arch]})).runs.values()
    spec = copy.deepcopy(spec)
    spec.train.total_steps, spec.train.snapshot_steps = 4, [2, 4]
    paths = RunPaths(tmp_path / "run", tmp_path / "work")
    train(spec, shards, paths, progress=False)
    final = load_file(paths.weights)
    models = {s: load_snapshot(spec, p) for s, p in list_snapshots(run_folder(paths))}
    assert sorted(models) == [2, 4]
    assert all(torch.equal(models[4].state_dict()[k], final[k]) for k in final)
    assert not all(torch.equal(models[2].state_dict()[k], final[k]) for k in final)
    other = copy.deepcopy(spec)
    other.run_id = "someone_else"
    with pytest.raises(DataError, match="not 'someone_else'"):
        load_snapshot(other, snapshot_path(run_folder(paths), 2))


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


# -- probes of the snapshots ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def probed_run(tiny_data, tmp_path_factory):
    """A 12-step run with snapshots at steps 2 and 12, probed with at_steps on."""
    from depthbench.probes.run import run_probes

    _, exp, shards = tiny_data
    root = tmp_path_factory.mktemp("probed")
    spec = _spec(exp, 12, [2, 12], checkpoint_every=100)
    paths = RunPaths(
        root / "runs" / spec.run_id, root / "work"
    )  # the probe stage checks the folder's run id
    train(spec, shards, paths, progress=False)
    out = root / "probes.parquet"
    settings = {"n_sequences": 4, "seq_len": 16, "at_steps": [2]}
    run_probes(spec.to_dict(), str(shards), str(paths.run_dir), str(out), settings)
    return spec, pd.read_parquet(out)


def test_the_probe_of_the_final_snapshot_equals_the_final_models_probe(probed_run):
    spec, df = probed_run
    key = ["probe", "i", "j"]
    trained = df[df.stage == "trained"].set_index(key)["value"].sort_index()
    final = df[(df.stage == "snapshot") & (df.step == 12)].set_index(key)["value"].sort_index()
    assert len(trained) > 20 and list(trained.index) == list(final.index)
    assert {
        "causal_share",
        "permutation_share",
        "angular_distance_last",
        "token_similarity",
    } <= set(trained.index.get_level_values(0))
    assert (final - trained).abs().max() < 1e-6
    assert set(df.loc[df.stage == "trained", "step"]) == {12} and set(
        df.loc[df.stage == "init", "step"]
    ) == {0}


def test_every_snapshot_gets_the_final_models_probe_families(probed_run):
    _, df = probed_run
    snap = df[df.stage == "snapshot"]
    assert sorted(snap.step.unique()) == [2, 12]
    families = {s: set(g.probe) for s, g in snap.groupby("step")}
    assert families[2] == families[12] == set(df.loc[df.stage == "trained", "probe"])
    early = snap[(snap.step == 2) & (snap.probe == "angular_distance_last")].set_index(["i", "j"])[
        "value"
    ]
    late = snap[(snap.step == 12) & (snap.probe == "angular_distance_last")].set_index(["i", "j"])[
        "value"
    ]
    assert (early - late).abs().max() > 1e-4  # different weights, different geometry


def test_probes_table_keeps_final_rows_and_carries_the_steps(probed_run, tmp_path):
    from depthbench.analysis.stage_tables import probe_rows

    spec, df = probed_run
    df.to_parquet(tmp_path / "p.parquet", index=False)
    old = df[df.stage != "snapshot"].drop(columns=["step"])  # a probe file written before `step`
    old.assign(run_id="older").to_parquet(tmp_path / "old.parquet", index=False)
    runs = pd.DataFrame(
        [
            {
                "run_id": r,
                "experiment": "t",
                "arch": spec.arch,
                "n_layer": 2,
                "d_model": 48,
                "ratio": 24.0,
                "params": 1,
                "lr": spec.lr,
                "seed": 0,
                "knobs": "{}",
                "final_val_loss": 5.0,
                "status": "ok",
            }
            for r in (spec.run_id, "older")
        ]
    )
    best = pd.DataFrame(
        [{"arch": spec.arch, "n_layer": 2, "d_model": 48, "knobs": "{}", "best_lr": spec.lr}]
    )
    table = probe_rows([tmp_path / "p.parquet", tmp_path / "old.parquet"], runs, best)
    mine = table[table.run_id == spec.run_id]
    assert len(mine[mine.stage == "trained"]) == len(df[df.stage == "trained"])
    assert mine.loc[mine.stage == "trained", "step"].tolist() == [12] * len(
        df[df.stage == "trained"]
    )
    assert table.loc[table.run_id == "older", "step"].isna().all()
    assert str(table["step"].dtype) == "Int64"


# -- figures -------------------------------------------------------------------------------------
STEPS = [1, 3, 8, 24, 69, 200]


def step_table() -> pd.DataFrame:
    """A probes table with snapshot rows of two architectures at two depths (and a worse LR, and
    the final and init rows the figures must not mistake for snapshots)."""
    rng = np.random.default_rng(0)
    rows = []
    for arch, d, base in (("pre_ln", 64, 0.1), ("hc", 56, 0.3)):
        for L in (2, 4):
            for lr, best in ((1e-3, True), (1e-2, False)):
                run = f"{arch}_L{L}_lr{lr}"
                meta = {
                    "run_id": run,
                    "arch": arch,
                    "n_layer": L,
                    "d_model": d,
                    "knobs": "{}",
                    "lr": lr,
                    "seed": 0,
                    "is_best_lr": best,
                    "status": "ok",
                }
                for stage, steps in (("snapshot", STEPS), ("trained", [200]), ("init", [0])):
                    for step in steps:
                        grow = base * np.log1p(step) / np.log1p(200) + (0 if best else 5)
                        for l in range(L + 1):
                            rows.append(
                                {
                                    **meta,
                                    "stage": stage,
                                    "step": step,
                                    "probe": "token_similarity",
                                    "i": l,
                                    "j": -1,
                                    "value": grow + 0.01 * l,
                                }
                            )
                        if stage == "init":
                            continue
                        for l in range(L):
                            for k in range(1, L - l + 1):
                                rows.append(
                                    {
                                        **meta,
                                        "stage": stage,
                                        "step": step,
                                        "probe": "angular_distance_last",
                                        "i": l,
                                        "j": k,
                                        "value": grow * (1 + 0.1 * l)
                                        + 0.05 * k
                                        + rng.uniform(0, 0.01),
                                    }
                                )
                        for probe in ("causal_share", "permutation_share"):
                            rows.append(
                                {
                                    **meta,
                                    "stage": stage,
                                    "step": step,
                                    "probe": probe,
                                    "i": -1,
                                    "j": -1,
                                    "value": grow / (2 if probe == "causal_share" else 3),
                                }
                            )
    return pd.DataFrame(rows).astype({"step": "Int64"})


def test_probes_over_training_draws_each_quantity_per_step_on_a_log_axis():
    from depthbench.analysis import step_figures
    from depthbench.analysis.style import Context

    table = step_table()
    fig = step_figures.probes_over_training({"probes": table}, Context())
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 2 * 4  # depths x quantities
    best = table[(table.stage == "snapshot") & table.is_best_lr]
    for ax in axes:
        assert ax.get_xscale() == "log" and ax.get_xlabel() and ax.get_ylabel()
        L = int(ax.get_title().split("L=")[1].split(",")[0])
        lines = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
        assert set(lines) == {"pre_ln", "hc"}
        for arch, line in lines.items():
            rows = best[(best.arch == arch) & (best.n_layer == L)]
            if ax.get_title().startswith("adjacent"):
                g = rows[(rows.probe == "angular_distance_last") & (rows.j == 1)]
                want = [
                    g[g.step == s].value.mean() for s in STEPS
                ]  # mean over layers l of d(l, l+1)
            elif ax.get_title().startswith("token"):
                g = rows[(rows.probe == "token_similarity") & (rows.i == L)]
                want = [g[g.step == s].value.iloc[0] for s in STEPS]
            else:
                probe = (
                    "causal_share" if ax.get_title().startswith("causal") else "permutation_share"
                )
                want = [rows[(rows.probe == probe) & (rows.step == s)].value.iloc[0] for s in STEPS]
            np.testing.assert_allclose(line.get_xdata(), STEPS)
            np.testing.assert_allclose(line.get_ydata(), want)
    assert {t.get_text() for t in fig.legends[0].get_texts()} >= {
        "pre_ln",
        "hc",
        "token similarity at init (step 0)",
    }


def test_adjacent_distance_heatmap_holds_each_layer_and_step():
    from depthbench.analysis import step_figures
    from depthbench.analysis.style import Context

    table = step_table()
    fig = step_figures.adjacent_distance_over_training({"probes": table}, Context())
    meshes = [
        (ax, ax.collections[0])
        for ax in fig.axes
        if ax.collections and ax.get_label() != "<colorbar>"
    ]
    assert len(meshes) == 4  # architectures x depths
    assert any(ax.get_label() == "<colorbar>" and "d(l, l+1)" in ax.get_ylabel() for ax in fig.axes)
    for ax, mesh in meshes:
        arch, L = ax.get_title().split(",")[0], int(ax.get_title().split("L=")[1].split(",")[0])
        g = table[
            (table.stage == "snapshot")
            & table.is_best_lr
            & (table.arch == arch)
            & (table.n_layer == L)
            & (table.probe == "angular_distance_last")
            & (table.j == 1)
        ]
        want = np.array(
            [[g[(g.i == l) & (g.step == s)].value.iloc[0] for s in STEPS] for l in range(L)]
        )
        np.testing.assert_allclose(np.asarray(mesh.get_array()).reshape(L, len(STEPS)), want)
        assert ax.get_xscale() == "log"


def test_step_figures_say_what_is_missing_without_snapshot_rows():
    from depthbench.analysis import step_figures
    from depthbench.analysis.style import Context

    final_only = step_table().query("stage != 'snapshot'")
    for draw in (step_figures.probes_over_training, step_figures.adjacent_distance_over_training):
        fig = draw({"probes": final_only}, Context())
        assert any("probes.at_steps" in t.get_text() for ax in fig.axes for t in ax.texts)


# -- the workflow ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_workflow_keeps_probes_and_draws_the_snapshots(tmp_path, wiki_jsonl):
    """Snakemake on one tiny run with at_steps: the snapshots are a declared output holding exactly
    the resolved steps, the probes table has their rows, the figures are drawn, a second run does
    nothing, and changing at_steps retrains (the steps are a param of the train rule)."""
    import yaml

    from depthbench.grid.config import expand_grid
    from tests.workflow_runs import copy_workflow, job_counts, snakemake, write_config

    root = copy_workflow(tmp_path)
    config = tiny_config(
        wiki_jsonl,
        probes={"at_steps": {"log_spaced": 3}, "n_sequences": 4, "seq_len": 16},
        nll={"enabled": False, "max_docs_per_set": 8},
    )
    write_config(root, config)
    # up to the probe figures (the stages this feature touches; the rest of the workflow is
    # test_workflow's): the probe rule's snapshots input exists only as the train rule's output
    snakemake(root, "--until", "probe_figures")
    ((run_id, spec),) = expand_grid(
        load_config(yaml.safe_load((root / "config/config.yaml").read_text()))
    ).runs.items()
    total = spec.train.total_steps
    want = resolve_steps({"log_spaced": 3}, total)
    assert len(want) == 3 and want[-1] == total
    assert [s for s, _ in list_snapshots(root / f"results/runs/{run_id}/snapshots")] == want
    probes = pd.read_parquet(root / "results/tables/probes.parquet")
    assert sorted(probes.loc[probes.stage == "snapshot", "step"].unique()) == want
    assert set(probes.loc[probes.stage == "trained", "step"]) == {total}
    for name in ("probes_over_training", "adjacent_distance_over_training"):
        assert (root / f"results/figures/{name}.png").stat().st_size > 10_000
    again = snakemake(root, "-n", "--until", "probe_figures")
    assert "Nothing to be done" in again.stdout + again.stderr
    config["probes"]["at_steps"] = [2]
    write_config(root, config)
    assert job_counts(snakemake(root, "-n").stdout).get("train") == 1
