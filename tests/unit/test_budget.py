"""The fixed parameter budget (every solved shape within budget.tolerance, or a config error
naming it) and the best-LR table a reader can trust (edge flag, seed statistics)."""

import json
import math
import re
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from depthbench.grid.config import expand_grid
from depthbench.grid.expand import shape_table
from depthbench.spec.schema import load_config
from depthbench.util.errors import ConfigError
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model, count_parameters
from depthbench.spec.shapes import FF_BAND, solve_width
from depthbench.analysis.tables import GROUP_COLUMNS, best_learning_rates, best_lr_run_ids, run_rows
from depthbench.analysis.tables import replicate_run_ids
from tests.conftest import tiny_config
from depthbench.models.registry import PACKAGE_ARCHITECTURES

REPO = Path(__file__).resolve().parents[2]
ALL_ARCHS = list(PACKAGE_ARCHITECTURES)  # every architecture of the package
BUDGETED = [
    "config/config.yaml",
    "config/presets/cpu_all.yaml",
    "config/presets/400m.yaml",
    "config/presets/1p6b.yaml",
]


@pytest.mark.parametrize("path", BUDGETED)
def test_every_preset_shape_is_within_tolerance_for_every_architecture(path):
    config = load_config(REPO / path, {"architectures": ALL_ARCHS})
    budget = config["budget"]
    rows = shape_table(expand_grid(config))
    assert len(rows) == len(ALL_ARCHS) * len(config["shapes"])
    for r in rows:
        # n_params is the count of the model as built (the solver checks it against a full build)
        assert abs(r["params"] / budget["params"] - 1) <= budget["tolerance"], r
        assert r["params_vs_budget"] == pytest.approx(r["params"] / budget["params"] - 1, abs=1e-12)
        assert r["d_model"] % budget["d_model_multiple"] == 0, r
        assert abs(r["d_ff"] / r["d_model"] / (8 / 3) - 1) <= FF_BAND + 1e-12, r
    if path.endswith("400m.yaml"):  # the paper's widths are kept
        assert {r["d_model"] for r in rows} == {1216, 1088, 1024, 896, 832, 704, 640}


def test_solved_counts_are_the_built_models_counts():
    """The solver's count (extrapolated in depth) against a plain sum over the built model."""
    for arch in ("pre_ln", "hc", "mhc", "attnres_block"):
        base = ModelConfig(arch=arch, vocab_size=2048, n_head=4)
        shape = solve_width(base, 8, 8e5, multiple=8, ff_multiple=32, ff_step=4)
        cfg = ModelConfig(
            arch=arch, vocab_size=2048, n_head=4, n_layer=8, d_model=shape.d_model, d_ff=shape.d_ff
        )
        with torch.device("meta"):
            model = build_model(cfg, initialize=False)
        built = sum(p.numel() for p in model.parameters())
        assert shape.n_params == built
        assert abs(built / 8e5 - 1) <= 0.01


def test_a_shape_out_of_tolerance_names_the_shape_and_the_nearest_counts(wiki_jsonl):
    budget = {
        "params": 1.0e5,
        "d_model_multiple": 16,
        "d_ff_multiple": 16,
        "d_ff_step": 64,
        "tolerance": 0.001,
    }
    config = load_config(
        tiny_config(wiki_jsonl, budget=budget, shapes=[{"n_layer": 1}, {"n_layer": 2}])
    )
    with pytest.raises(ConfigError) as info:
        expand_grid(config)
    err = info.value
    assert err.field in ("shapes[0]", "shapes[1]"), str(err)
    n_layer = int(err.field[-2]) + 1
    found = re.findall(r"([\d,]+) \(([+-]\d+\.\d+)%, d_model=(\d+), d_ff=(\d+)\)", str(err))
    assert len(found) == 2, str(err)
    (below, _, d_lo, f_lo), (above, _, d_hi, f_hi) = found
    below, above = int(below.replace(",", "")), int(above.replace(",", ""))
    assert below < 1.0e5 < above  # they bracket the budget, both outside the tolerance
    assert min(1.0e5 - below, above - 1.0e5) > 0.001 * 1.0e5
    for count, d_model, d_ff in ((below, d_lo, f_lo), (above, d_hi, f_hi)):  # and they are real
        cfg = ModelConfig(
            vocab_size=512,
            n_head=2,
            n_layer=n_layer,
            d_model=int(d_model),
            d_ff=int(d_ff),
            max_seq_len=32,
        )
        assert count_parameters(cfg) == count
    assert "budget.tolerance" in str(err) and "budget.d_ff_step" in str(err)


def test_explicit_shapes_stay_as_given_and_report_their_deviation(wiki_jsonl):
    exp = expand_grid(
        load_config(tiny_config(wiki_jsonl, shapes=[{"n_layer": 2, "d_model": 64, "d_ff": 96}]))
    )
    (row,) = shape_table(exp)
    cfg = ModelConfig(vocab_size=512, n_head=2, n_layer=2, d_model=64, d_ff=96, max_seq_len=32)
    assert (row["d_model"], row["d_ff"], row["params"]) == (64, 96, count_parameters(cfg))
    assert row["params_vs_budget"] == pytest.approx(count_parameters(cfg) / 1.0e5 - 1)
    assert abs(row["params_vs_budget"]) > 0.01  # far off the budget, and no error


def test_cli_shapes_prints_params_vs_budget(capsys):
    from depthbench.commands.cli import main

    budget = load_config(str(REPO / "config/config.yaml"))["budget"]["params"]
    assert main(["shapes", str(REPO / "config/config.yaml")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[-1] == "params_vs_budget"
    for line in lines[1:]:
        fields = line.split()
        params = int(fields[-2].replace(",", ""))
        assert float(fields[-1]) == pytest.approx(params / budget - 1, abs=5e-5)


def _summary(
    tmp_path: Path, spec: dict, lr: float, seed: int, loss: float, status: str = "ok"
) -> str:
    spec = {**spec, "lr": lr, "seed": seed, "run_id": f"r_L{spec['shape']['n_layer']}_{lr}_{seed}"}
    path = tmp_path / spec["run_id"] / "summary.json"  # a summary lives in its run's folder
    path.parent.mkdir()
    path.write_text(
        json.dumps(
            {
                "run_id": spec["run_id"],
                "spec": spec,
                "n_params": spec["shape"]["n_params"],
                "status": status,
                "final_val_loss": loss if status == "ok" else math.nan,
                "steps": 10,
                "total_steps": 10,
                "tokens_seen": 1000,
                "wall_seconds": 1.0,
                "tokens_per_s": 1000.0,
            }
        )
    )
    return str(path)


def test_runs_and_best_lr_with_two_seeds(wiki_jsonl, tmp_path):
    exp = expand_grid(
        load_config(tiny_config(wiki_jsonl, shapes=[{"n_layer": 2}, {"n_layer": 3}]))
    )  # tolerance 0.5
    specs = {s.shape.n_layer: s.to_dict() for s in exp.runs.values()}
    # L=2: 2e-3 is best (interior); L=3: 4e-3, the largest LR tried, is best (at the edge).
    losses = {
        (2, 1e-3): [3.10, 3.20],
        (2, 2e-3): [3.00, 3.06],
        (2, 4e-3): [3.30, 3.10],
        (3, 1e-3): [3.50, 3.40],
        (3, 2e-3): [3.20, 3.30],
        (3, 4e-3): [3.05, 2.99],
    }
    paths = [
        _summary(tmp_path, specs[L], lr, seed, v)
        for (L, lr), vs in losses.items()
        for seed, v in enumerate(vs)
    ]
    runs = run_rows(paths, unigram_floor=5.0, experiment="t", budget_params=1.0e5)
    for L, spec in specs.items():
        got = runs[runs["n_layer"] == L]
        assert (got["budget_params"] == 1.0e5).all()
        assert got["params_vs_budget"].iloc[0] == pytest.approx(
            spec["shape"]["n_params"] / 1.0e5 - 1
        )
    assert run_rows(paths[:1], 5.0, "t")["params_vs_budget"].isna().all()  # no budget: NaN

    best = best_learning_rates(runs).set_index("n_layer")
    assert best.loc[2, "best_lr"] == 2e-3 and not best.loc[2, "lr_at_edge"]
    assert best.loc[3, "best_lr"] == 4e-3 and best.loc[3, "lr_at_edge"]
    for L, lr in ((2, 2e-3), (3, 4e-3)):
        assert best.loc[L, "final_val_loss"] == pytest.approx(statistics.mean(losses[(L, lr)]))
        assert best.loc[L, "final_val_loss_std"] == pytest.approx(statistics.stdev(losses[(L, lr)]))
        assert best.loc[L, "n_seeds"] == 2
        assert best.loc[L, "params_vs_budget"] == pytest.approx(
            specs[L]["shape"]["n_params"] / 1.0e5 - 1
        )

    # A diverged larger LR is still tried: 4e-3 becomes interior at L=3.
    paths.append(_summary(tmp_path, specs[3], 8e-3, 0, math.nan, status="diverged"))
    best = best_learning_rates(run_rows(paths, 5.0, "t", 1.0e5)).set_index("n_layer")
    assert best.loc[3, "best_lr"] == 4e-3 and not best.loc[3, "lr_at_edge"]
    assert best.loc[3, "n_diverged"] == 1 and best.loc[3, "n_lrs_tried"] == 4


def test_best_lr_with_one_seed_has_nan_spread():
    runs = pd.DataFrame(
        {
            "experiment": "t",
            "arch": "pre_ln",
            "n_layer": 2,
            "d_model": 32,
            "knobs": "{}",
            "ratio": 16.0,
            "params": 1000,
            "params_vs_budget": 0.001,
            "lr": [1e-3, 2e-3],
            "seed": 0,
            "status": "ok",
            "final_val_loss": [3.0, 3.1],
        }
    )
    (row,) = best_learning_rates(runs).to_dict("records")
    assert row["best_lr"] == 1e-3 and row["lr_at_edge"] and row["n_seeds"] == 1
    assert math.isnan(row["final_val_loss_std"])
    assert set(GROUP_COLUMNS) <= set(row)


def test_best_lr_runs_are_every_finished_seed_at_each_cells_best_lr():
    """`probes.runs: best_lr` evaluates these runs: picked here by hand from the losses."""
    rows = []
    for n_layer, d_model, losses in (
        (2, 32, {1e-3: (3.0, 3.2), 2e-3: (2.9, 3.1)}),
        (4, 24, {1e-3: (3.0, 3.0), 2e-3: (3.5, 3.6)}),
    ):
        for lr, per_seed in losses.items():
            for seed, loss in enumerate(per_seed):
                rows.append(_hc_row(n_layer, d_model, lr, seed, loss, f"L{n_layer}_lr{lr}_s{seed}"))
    rows.append(
        {
            **rows[-1],
            "seed": 2,
            "status": "diverged",
            "final_val_loss": math.nan,
            "run_id": "L4_lr0.002_s2",
        }
    )
    rows.append(
        {
            **rows[4],
            "seed": 2,
            "status": "diverged",
            "final_val_loss": math.nan,
            "run_id": "L4_lr0.001_s2",
        }
    )
    runs = pd.DataFrame(rows)
    grid_order = list(reversed(runs["run_id"].tolist())) + ["not_in_table"]
    picked = best_lr_run_ids(runs, best_learning_rates(runs), grid_order)
    # L=2: 2e-3 has the lower seed mean (3.0 < 3.1); L=4: 1e-3 (3.0 < 3.55); the diverged seed of
    # the best LR is not evaluated, and the grid's order is kept.
    assert picked == ["L4_lr0.001_s1", "L4_lr0.001_s0", "L2_lr0.002_s1", "L2_lr0.002_s0"]
    assert best_lr_run_ids(runs.iloc[0:0], best_learning_rates(runs.iloc[0:0]), grid_order) == []


def _hc_row(n_layer: int, d_model: int, lr: float, seed: int, loss: float, run_id: str) -> dict:
    """One finished hc run's runs.parquet row."""
    return {
        "experiment": "t",
        "arch": "hc",
        "n_layer": n_layer,
        "d_model": d_model,
        "knobs": "{}",
        "ratio": d_model / n_layer,
        "params": 1000,
        "params_vs_budget": 0.0,
        "lr": lr,
        "seed": seed,
        "status": "ok",
        "final_val_loss": loss,
        "run_id": run_id,
    }


def _cell_runs(losses: dict[tuple[float, int], float]) -> pd.DataFrame:
    """One hc cell's runs, {(lr, seed): final loss}."""
    return pd.DataFrame(
        [_hc_row(2, 32, lr, seed, loss, f"lr{lr}_s{seed}") for (lr, seed), loss in losses.items()]
    )


def test_best_lr_with_replicates_is_chosen_on_the_sweep_seeds_and_reported_over_all():
    """seeds_at_best_lr: the replicates of the chosen LR (seed 1, a worse draw: 5.4) must not
    move the choice to the LR that has only the sweep's seed (5.1 < the mean 5.2), and the row
    reports the mean, n and interval over both seeds."""
    runs = _cell_runs({(1e-3, 0): 5.0, (1e-3, 1): 5.4, (2e-3, 0): 5.1})
    (row,) = best_learning_rates(runs, sweep_seeds=[0]).to_dict("records")
    assert row["best_lr"] == 1e-3 and row["n"] == 2 and row["n_seeds"] == 2
    assert row["final_val_loss"] == pytest.approx(5.2)
    assert row["final_val_loss_std"] == pytest.approx(np.std([5.0, 5.4], ddof=1))
    assert row["ci_low"] < 5.0 and row["ci_high"] > 5.4  # the t interval of two seeds is wide
    # without the sweep's seeds named, the choice is the lower seed mean: selection bias
    (biased,) = best_learning_rates(runs).to_dict("records")
    assert biased["best_lr"] == 2e-3


def test_replicates_exist_only_at_each_cells_best_lr():
    runs = _cell_runs({(1e-3, 0): 5.0, (2e-3, 0): 5.1})
    replicates = {"lr0.002_s0": {"lr0.002_s1": None}, "lr0.001_s0": {"lr0.001_s1": None}}
    best = best_learning_rates(runs)
    assert replicate_run_ids(runs, best, replicates) == ["lr0.001_s1"]
    assert replicate_run_ids(runs.iloc[0:0], best.iloc[0:0], replicates) == []


def test_seeds_at_best_lr_adds_the_next_seeds_to_every_sweep_run_as_candidates(tiny_data):
    """Each sweep run at the first seed gets the seeds after the largest of `seeds` (here 3 and 4
    to reach 4 seeds from [0, 2]); a replicate is the run the plain `seeds:` product would give."""
    from depthbench.grid.config import expand_grid

    config, _, _ = tiny_data
    config = {**config, "learning_rates": [1e-3, 3e-3], "seeds": [0, 2], "seeds_at_best_lr": 4}
    exp = expand_grid(config)
    assert len(exp.runs) == 4 and set(exp.replicates) == {
        r for r, s in exp.runs.items() if s.seed == 0
    }
    product = expand_grid({**config, "seeds": [0, 2, 3, 4], "seeds_at_best_lr": 0})
    assert not product.replicates
    replicas = {r: s for reps in exp.replicates.values() for r, s in reps.items()}
    assert sorted(s.seed for s in replicas.values()) == [3, 3, 4, 4]
    for run_id, spec in replicas.items():
        assert product.runs[run_id].identity_dict() == spec.identity_dict()
    assert set(exp.candidate_runs) == set(product.runs)
