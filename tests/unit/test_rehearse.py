"""`depthbench rehearse` (depthbench.commands.rehearse.rehearsal, .command and .rss).

The tiny rehearsal checks what the command promises: every shape resumes to the state it saved
(a fingerprint taken before the save, compared after the live state was destroyed and resumed),
the model trained has the shape solver's parameter count, every probe family ran, and the
measured peak RSS (the kernel's high-water mark, independent of the estimator) is within a
factor of 1.5 of the analytic estimate at a size (~1.8M parameters) where the weights, not
Python's allocations, dominate. The 1.6B preset is checked on the meta device: parameter count,
FSDP2 units, and no host memory allocated for its 6.4 GB of fp32 weights.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
import yaml

from depthbench.commands.rehearse import rehearsal as rh
from depthbench.commands.rehearse import roundtrip
from depthbench.commands.rehearse import command as rehearse_run
from depthbench.commands.cli import main
from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.commands.rehearse.rss import PeakRSS
from depthbench.spec.shape_count import shape_of
from depthbench.spec.run import RunSpec
from depthbench.spec.training import TrainConfig
from tests.conftest import REPO, tiny_config

FACTOR = 1.5  # measured peak RSS / estimate must lie in [1 / FACTOR, FACTOR]


@pytest.fixture(scope="module")
def tiny_exp(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    corpus.write_text('{"text": "unused: the rehearsal draws random tokens"}\n')
    cfg = tiny_config(
        corpus, architectures=["pre_ln", "attnres_block"], shapes=[{"n_layer": 2}, {"n_layer": 4}]
    )
    cfg["budget"] = {
        "params": 1.8e6,
        "d_model_multiple": 32,
        "d_ff_multiple": 32,
        "tolerance": 0.05,
    }
    cfg["train"] = {**cfg["train"], "seq_len": 64}
    return expand_grid(load_config(cfg))


@pytest.fixture(scope="module")
def tiny_report(tiny_exp, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("rehearsal")
    return out, rehearse_run.rehearse_experiment(
        tiny_exp, out, tokens=64, probe_tokens=16, probe_passes=1
    )


def test_rehearsal_rows(tiny_exp, tiny_report):
    out, report = tiny_report
    rows = report["rows"]
    assert [(r["arch"], r["shape"]) for r in rows] == [
        (a, s) for a in ("pre_ln", "attnres_block") for s in ("widest", "deepest")
    ]
    solved = {(s.arch, s.shape.n_layer): s.shape for s in tiny_exp.runs.values()}
    for r in rows:
        assert r["mode"] == "real" and r["status"] == "ok", r
        assert r["resume_equal"] is True and r["resume_mismatch"] == []
        assert r["steps"] == rh.STEPS and math.isfinite(r["loss"])
        shape = solved[(r["arch"], r["n_layer"])]
        assert r["params"] == shape.n_params == r["solver_params"]
        assert r["d_model"] == shape.d_model
        # the checkpoint holds fp32 weights and two fp32 AdamW moments: >= 12 bytes per parameter
        assert r["checkpoint_bytes"] >= 12 * r["params"]
        assert {"causal_score", "permutation_score", "usefulness_ratio", "effective_rank"} <= set(
            r["probe_families"]
        )
        assert r["probe_finite"]
    by = {(r["arch"], r["shape"]): r for r in rows}
    for arch in ("pre_ln", "attnres_block"):
        assert by[(arch, "widest")]["d_model"] > by[(arch, "deepest")]["d_model"]
        assert by[(arch, "widest")]["n_layer"] < by[(arch, "deepest")]["n_layer"]
    # attnres_block's own probe families ran too
    assert {"depth_weight", "dead_zone_layers"} <= set(
        by[("attnres_block", "deepest")]["probe_families"]
    )
    assert not (out / "work").exists() or not any((out / "work").iterdir())  # checkpoints removed


def test_rehearsal_memory_within_factor(tiny_report):
    _, report = tiny_report
    for r in report["rows"]:
        assert r["rss_method"] == "vmhwm"  # Linux: the exact high-water mark
        assert 1 / FACTOR <= r["ratio"] <= FACTOR, (
            r["arch"],
            r["tag"],
            r["measured_gib"],
            r["est_gib"],
        )
        # weights, gradients and two AdamW moments: 4 fp32 copies of the parameters
        assert r["est_weights_gib"] * 2**30 == pytest.approx(4 * r["params"])
        assert r["est_adamw_gib"] == pytest.approx(2 * r["est_weights_gib"])


def test_rehearsal_files(tiny_report):
    out, report = tiny_report
    saved = json.loads((out / "rehearsal.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    csv = pd.read_csv(out / "rehearsal.csv")
    assert list(csv["arch"]) == [r["arch"] for r in report["rows"]]
    assert list(csv["params"]) == [r["params"] for r in report["rows"]]
    table = rehearse_run.format_report(report)
    assert "peak GiB" in table and "4 shapes" in table and "0 not ok" in table


def _trainer(tmp_path, arch="pre_ln"):
    from contextlib import nullcontext

    from depthbench.train.distributed import DistContext
    from depthbench.train.recipe import RunPaths
    from depthbench.train.trainer import Trainer

    cfg = ModelConfig(arch=arch, vocab_size=64, max_seq_len=16, d_model=32, n_layer=2, n_head=2)
    spec = RunSpec(
        run_id="r",
        arch=arch,
        shape=shape_of(cfg, 2, 32),
        lr=1e-3,
        seed=0,
        knobs={},
        model=cfg,
        train=TrainConfig(
            seq_len=16, micro_batch_size=1, global_batch_size=1, total_steps=10, device="cpu"
        ),
        data_id="d",
        tokenizer_id="t",
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, 17))
    trainer = Trainer(
        spec,
        RunPaths(tmp_path, tmp_path),
        build_model(cfg),
        rh._OneBatch(ids),
        DistContext(),
        torch.device("cpu"),
        nullcontext(),
    )
    trainer.fit(stop_after=2)
    return trainer


def test_roundtrip_detects_a_resume_that_loads_nothing(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    good = roundtrip.checkpoint_roundtrip(trainer)
    assert good["resume_equal"] and trainer.step == 2
    monkeypatch.setattr(roundtrip, "resume_state", lambda t: True)  # claims success, loads nothing
    bad = roundtrip.checkpoint_roundtrip(trainer)
    assert not bad["resume_equal"]
    assert any(k.startswith("model.") for k in bad["resume_mismatch"]) and trainer.step == 0


def test_targets_order_and_filter(tiny_exp):
    targets = rh.rehearsal_targets(tiny_exp, ["attnres_block", "pre_ln"], ("deepest",))
    assert [(t.arch, t.which, t.spec.shape.n_layer) for t in targets] == [
        ("attnres_block", "deepest", 4),
        ("pre_ln", "deepest", 4),
    ]
    with pytest.raises(ValueError, match="--shapes"):
        rh.rehearsal_targets(tiny_exp, None, ("tallest",))
    # "both" (the CLI's documented spelling of the default) is the widest and the deepest
    both = rh.rehearsal_targets(tiny_exp, ["pre_ln"], ("both",))
    assert [(t.which, t.spec.shape.n_layer) for t in both] == [
        (t.which, t.spec.shape.n_layer)
        for t in rh.rehearsal_targets(tiny_exp, ["pre_ln"], ("widest", "deepest"))
    ]
    assert {t.which for t in both} == {"widest", "deepest"}


def test_guard_refuses_or_goes_meta(tiny_exp, tmp_path, monkeypatch):
    monkeypatch.setattr(rehearse_run, "available_memory", lambda: 2**20)  # 1 MiB left
    monkeypatch.setattr(
        rehearse_run,
        "rehearse_real",
        lambda *a, **k: pytest.fail("built a model that does not fit"),
    )
    refused = rehearse_run.rehearse_experiment(
        tiny_exp, tmp_path / "r", mode="real", archs=["pre_ln"], tokens=64, log=lambda s: None
    )
    assert [r["status"] for r in refused["rows"]] == ["refused", "refused"]
    assert "GiB available" in refused["rows"][0]["note"]
    auto = rehearse_run.rehearse_experiment(
        tiny_exp, tmp_path / "a", mode="auto", archs=["pre_ln"], tokens=64, log=lambda s: None
    )
    assert [r["mode"] for r in auto["rows"]] == ["meta", "meta"] and all(
        r["status"] == "ok" for r in auto["rows"]
    )
    with pytest.raises(ValueError, match="max_seq_len"):
        rehearse_run.rehearse_experiment(tiny_exp, tmp_path / "x", tokens=65)
    with pytest.raises(ValueError, match="--archs"):
        rehearse_run.rehearse_experiment(tiny_exp, tmp_path / "x", archs=["nope"])


def test_meta_mode_on_the_1p6b_preset(tmp_path, capsys):
    cfg = yaml.safe_load((REPO / "config/presets/1p6b.yaml").read_text())
    cfg["architectures"] = [
        "pre_ln"
    ]  # one architecture: the solver's time, not the check's, dominates
    path = tmp_path / "1p6b.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with PeakRSS() as mem:
        code = main(["rehearse", str(path), "--meta", "--out", str(tmp_path / "out")])
    assert code == 0
    rows = json.loads((tmp_path / "out/rehearsal.json").read_text())["rows"]
    solved = {s.shape.n_layer: s.shape for s in expand_grid(load_config(str(path))).runs.values()}
    assert [r["n_layer"] for r in rows] == [min(solved), max(solved)]  # widest, deepest
    for r in rows:
        assert r["mode"] == "meta" and r["all_meta"] and r["status"] == "ok"
        assert r["params"] == solved[r["n_layer"]].n_params and abs(r["params"] / 1.6e9 - 1) <= 0.01
        assert r["fsdp_units"] == r["n_layer"] and r["units_are_blocks"]
        assert r["world"] == 16 and r["parallel"] == "fsdp"
        assert r["gpu_gib_ac"] < r["gpu_gib"]
        # fp32 weights alone would be 6 GiB: the host grew by far less than one block's worth
        assert r["meta_rss_gib"] < 0.25
    assert mem.peak < 2**30
    assert "GPU GiB" in capsys.readouterr().out


def test_probe_passes_bound_each_intervention_family():
    """`probe_passes=1` evaluates one pass per family: at L = 3 the causal matrix keeps row 1 of
    its rows 1-2 (2 of 3 entries), the permutation matrix pair (1, 2) of its 3 pairs and the
    usefulness ratios layer 1 of 3, so 5 rows fewer than in full; every row left is finite."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="pre_ln", vocab_size=64, d_model=32, n_layer=3, n_head=2, max_seq_len=16)
    model = build_model(cfg)
    full = rh.run_probe_families(model, 64, 8, passes=0, seed=0)
    bounded = rh.run_probe_families(model, 64, 8, passes=1, seed=0)
    assert full["probe_rows"] - bounded["probe_rows"] == 1 + 2 + 2
    assert full["probe_families"] == bounded["probe_families"]
    assert full["probe_finite"] and bounded["probe_finite"]


def test_peak_rss_sees_an_allocation():
    with PeakRSS() as m:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written
        del block
    assert 60 * 2**20 <= m.peak <= 80 * 2**20
