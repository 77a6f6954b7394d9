"""`depthbench plan`'s tokenization estimate, and the GPU presets' tokenization in pieces."""

import pytest

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from depthbench.commands.plan import (
    TOKENIZE_TOKENS_PER_S,
    SweepPlan,
    format_plan,
    tokenization_estimate,
)


@pytest.mark.parametrize("preset, pieces", [("400m", 7), ("1p6b", 32)])
def test_gpu_presets_tokenize_in_pieces_and_the_plan_prints_the_time(preset, pieces):
    """8B and 32B training tokens: one tokenize job would take 11 and 45 hours at the measured
    200,000 tokens/s per process; in pieces it is that divided by the piece count, which the
    plan's last line states with its basis (the Snakemake side:
    tests/workflow/test_workflow_plans.py)."""
    exp = expand_grid(load_config(f"config/presets/{preset}.yaml"))
    t = tokenization_estimate(exp)
    longest = max(s.train.total_steps * s.train.tokens_per_step for s in exp.runs.values())
    assert t.pieces == pieces and t.training_tokens == longest
    assert t.tokens == pytest.approx(longest / (1 - exp.config["corpus"]["val_fraction"]))
    assert t.seconds == pytest.approx(t.tokens / (TOKENIZE_TOKENS_PER_S * pieces))
    assert t.seconds < 3 * 3600  # the whole corpus (10B / 100B tokens) takes 2 h / 4.3 h
    line = format_plan(SweepPlan([], tokenization=t), "H100 SXM", 0.4, 80e9).splitlines()[-1]
    assert (
        line.startswith("tokenization: ")
        and f"in {pieces} parallel pieces: {t.seconds / 3600:,.1f} h" in line
    )
    assert f"{TOKENIZE_TOKENS_PER_S:,.0f} tokens/s per process" in line


def test_pre_tokenized_shards_have_no_tokenization_estimate(tmp_path):
    import numpy as np

    config = load_config("config/config.yaml")
    paths = []
    for name in ("train", "val"):
        np.arange(5000, dtype=np.uint16).tofile(tmp_path / f"{name}.bin")
        paths.append(str(tmp_path / f"{name}.bin"))
    config["corpus"] = {
        "name": "pre",
        "source": "shards",
        "train_paths": paths[:1],
        "val_paths": paths[1:],
        "dtype": "uint16",
        "eos_id": 0,
    }
    config["tokenizer"] = {
        "kind": "hub",
        "name": "x",
        "vocab_size": 512,
    }  # the default grid's, for which its budget is solved
    assert tokenization_estimate(expand_grid(config)) is None


def test_the_plan_counts_one_cells_replicates_per_cell_after_the_sweep():
    """seeds_at_best_lr: 3 over seeds [0] on the default grid: 2 replicates for each of its 18
    cells, whatever LR the sweep picks (the cost of a run does not depend on its LR)."""
    from depthbench.commands.plan import plan_experiment

    config = load_config("config/config.yaml")
    exp = expand_grid({**config, "seeds": [0], "seeds_at_best_lr": 3})
    plans = plan_experiment(exp)
    cells = {(s.arch, s.model.n_layer) for s in exp.runs.values()}
    assert len(cells) == 18 and len(plans.replicates) == 36 and len(plans) == len(exp.runs)
    by_cell = {(s.arch, s.model.n_layer): s for s in exp.runs.values()}
    assert sum(p.tokens for p in plans.replicates) == 2 * sum(
        s.train.total_steps * s.train.tokens_per_step for s in by_cell.values()
    )
    text = format_plan(plans, "H100 SXM", 0.4, 80e9)
    assert "after the LR sweep: 36 replicate runs at the cells' best LRs" in text


def _record(tmp_path, runs):
    import json

    path = tmp_path / "record.json"
    fields = {"device": "NVIDIA H200", "torch": "2.11", "commit": "abc", "recorded": "today"}
    path.write_text(json.dumps({**fields, "runs": runs}))
    return path


def test_a_record_gives_each_architectures_step_time_interpolated_in_depth(tmp_path):
    from depthbench.commands.step_records import find_record, load_record, record_name
    from depthbench.util.errors import DataError

    runs = [
        {"arch": "hc", "n_layer": 16, "step_time_vs_pre_ln": 1.2},
        {"arch": "hc", "n_layer": 70, "step_time_vs_pre_ln": 2.0},
        {"arch": "mhc", "n_layer": 70, "step_time_vs_pre_ln": 1.5},
    ]
    record = load_record(_record(tmp_path, runs))
    assert record.relative_step_time("hc", 16) == 1.2 and record.relative_step_time("hc", 70) == 2.0
    assert record.relative_step_time("hc", 43) == pytest.approx(1.6)  # halfway in L
    assert record.relative_step_time("hc", 8) == 1.2 and record.relative_step_time("hc", 99) == 2.0
    assert record.relative_step_time("mhc", 16) == 1.5  # one depth measured: it stands for all
    assert record.relative_step_time("moda", 16) is None
    assert record.relative_step_time("pre_ln", 16) == 1.0
    assert record_name("NVIDIA H200") == "nvidia-h200.json"
    assert find_record("auto", "H100 SXM", tmp_path).device == "NVIDIA H200"  # the only one
    assert find_record("none", "H100 SXM", tmp_path) is None
    (tmp_path / "second.json").write_text((tmp_path / "record.json").read_text())
    assert find_record("auto", "H100 SXM", tmp_path) is None  # two: neither is named after it
    bad = _record(tmp_path, [{"arch": "hc", "n_layer": 4}])
    with pytest.raises(DataError, match=r"runs\[0\] lacks \['step_time_vs_pre_ln'\]"):
        load_record(bad)


def test_the_plan_prices_runs_by_measured_step_times_and_marks_assumed_ones(tmp_path):
    from depthbench.commands.plan import plan_experiment
    from depthbench.commands.step_records import load_record

    exp = expand_grid(load_config("config/config.yaml"))
    plain = {p.run_id: p for p in plan_experiment(exp)}
    depths = sorted({s.model.n_layer for s in exp.runs.values()})
    runs = [{"arch": "hc", "n_layer": depths[0], "step_time_vs_pre_ln": 3.0}]
    record = load_record(_record(tmp_path, runs))
    priced = plan_experiment(exp, record=record)
    for p in priced:
        spec = exp.runs[p.run_id]
        if spec.arch == "hc":
            pre_ln = [q for q in priced if exp.runs[q.run_id].arch == "pre_ln"]
            assert p.step_factor == 3.0
            same = [q for q in pre_ln if exp.runs[q.run_id].model.n_layer == spec.model.n_layer]
            # three times pre_ln's work at the shape (pre_ln's width there is at least hc's)
            assert 2.7 * same[0].gpu_hours <= p.gpu_hours <= 3.0 * same[0].gpu_hours
        else:  # pre_ln is the reference; the others are not in the record
            assert p.step_factor == (1.0 if spec.arch == "pre_ln" else None)
            assert p.gpu_hours == pytest.approx(plain[p.run_id].gpu_hours, rel=1e-12)
    text = format_plan(priced, "H100 SXM", 0.4, 80e9, record)
    assert "hc" in text and "measured 3x pre_ln (L = %d)" % depths[0] in text
    assert any(line.strip().startswith("mhc") and "assumed" in line for line in text.splitlines())
