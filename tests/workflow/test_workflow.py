"""End to end, as a user runs it: Snakemake on a tiny real grid in a copy of the repository, run
once for the module; each test reads its results or plans an edit of its config.

The grid replicates each cell's best learning rate with a second seed (`seeds_at_best_lr: 2`), so
the one run goes through the lr_sweep checkpoint too: 8 runs of the sweep (2 architectures x 2
depths x 2 learning rates, one of which diverges) and 4 replicates."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from tests.workflow_runs import (
    copy_workflow,
    edited_config,
    grid,
    job_counts,
    snakemake,
    write_config,
)

pytestmark = pytest.mark.slow


def replicated(wiki_jsonl, **overrides) -> dict:
    """The module's grid: the shared tiny grid with a second seed at each cell's best LR."""
    return grid(wiki_jsonl, **{"seeds_at_best_lr": 2, **overrides})


SWEEP, REPLICATES = 8, 4  # the runs of the LR sweep, and the replicates at the cells' best LR


@pytest.fixture(scope="module")
def workflow(tmp_path_factory, wiki_jsonl):
    """(root, the first run). The run prints its plan (Job stats) before any job starts: the
    plan a dry run would print, so none is run apart."""
    root = copy_workflow(tmp_path_factory.mktemp("wf"))
    write_config(root, replicated(wiki_jsonl))
    first = snakemake(root)
    return root, first


def test_default_workflow_writes_tables_and_figures(workflow):
    root = workflow[0]
    runs = pd.read_parquet(root / "results/tables/runs.parquet")
    assert len(runs) == SWEEP + REPLICATES
    assert set(runs.loc[runs.lr == 50.0, "status"]) == {"diverged"}
    ok = runs[runs.lr == 3e-3]
    assert set(ok.status) == {"ok"}
    assert (ok.final_val_loss < ok.unigram_floor - 0.3).all(), ok[
        ["run_id", "final_val_loss", "unigram_floor"]
    ]
    assert {"params", "tokens_seen", "wall_seconds", "tokens_per_s", "ratio"} <= set(runs.columns)
    best = pd.read_parquet(root / "results/tables/best_lr.parquet")
    assert len(best) == 4 and set(best.best_lr) == {3e-3}
    assert set(best.n_diverged) == {1}
    curves = pd.read_parquet(root / "results/tables/curves.parquet")
    assert set(curves.run_id) == set(runs.run_id) and curves.val_loss.notna().any()
    dynamics = pd.read_parquet(root / "results/tables/dynamics.parquet")
    assert set(dynamics.quantity) == {
        "residual_rms",
        "grad_norm_h",
        "param_grad_norm",
        "norm_factor",
    }
    for stem in ("headline", "loss_vs_lr", "loss_curves", "dynamics"):
        png = root / f"results/figures/{stem}.png"
        pdf = root / f"results/figures/{stem}.pdf"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert pdf.read_bytes()[:5] == b"%PDF-"
    # every rule has a log and a benchmark record
    assert (
        list((root / "results/logs/train").glob("*.log"))
        and len(list((root / "results/benchmarks/train").glob("*.tsv"))) == SWEEP + REPLICATES
    )


def test_probes_stage_writes_a_tidy_table_with_config_columns_and_figures(workflow):
    root = workflow[0]
    probes = pd.read_parquet(root / "results/tables/probes.parquet")
    runs = pd.read_parquet(root / "results/tables/runs.parquet")
    assert set(probes.run_id) == set(runs.run_id)
    assert {"probe", "stage", "i", "j", "value", "arch", "n_layer", "lr", "is_best_lr"} <= set(
        probes.columns
    )
    trained = probes[probes.stage == "trained"]
    assert set(trained.run_id) == set(
        runs.run_id[runs.status == "ok"]
    )  # diverged runs: init probes only
    for probe in (
        "angular_distance_last",
        "causal_score",
        "permutation_score",
        "usefulness_ratio",
        "token_similarity",
        "effective_rank",
        "causal_share",
        "permutation_share",
        "lens_cross_entropy",
        "lens_kl_to_final",
        "lens_top1_agreement",
    ):
        assert probe in set(trained.probe), probe
    assert {"init", "init_no_prefix_avg"} <= set(probes.stage)
    for name in (
        "angular_distance",
        "angular_distance_all",
        "angular_adjacent",
        "logit_lens",
        "removal_curves",
        "causal_matrix",
        "permutation_matrix",
        "probe_shares",
        "token_similarity",
        "effective_rank",
        "usefulness",
    ):
        assert (root / f"results/figures/{name}.png").stat().st_size > 10_000
    assert not (
        root / "results/figures/residual_product_rank.png"
    ).exists()  # no hc/mhc in this grid
    lens = pd.read_parquet(root / "results/tables/logit_lens.parquet")
    assert set(lens.run_id) == set(runs.run_id[runs.status == "ok"])
    assert (lens.groupby("run_id").size() == lens.groupby("run_id").n_layer.first() + 1).all()


FIGURES = [
    "headline",
    "loss_vs_lr",
    "loss_curves",
    "dynamics",
    "angular_distance",
    "angular_distance_all",
    "angular_adjacent",
    "logit_lens",
    "removal_curves",
    "causal_matrix",
    "permutation_matrix",
    "probe_shares",
    "token_similarity",
    "effective_rank",
    "usefulness",
    "nll_vs_ratio",
    "cost_vs_ratio",
    "loss_vs_cost",
]


def test_removal_tables_hold_every_ranking_domain_and_effective_depth(workflow):
    root = workflow[0]
    runs = pd.read_parquet(root / "results/tables/runs.parquet")
    removal = pd.read_parquet(root / "results/tables/removal.parquet")
    ok = set(runs.run_id[runs.status == "ok"])
    assert set(removal.run_id) == ok  # diverged runs: no rows
    assert set(removal.ranking) == {"angular_block", "block_influence", "causal", "last", "random"}
    assert set(removal.domain) == {"val", "code", "stem", "math"}
    for run_id, g in removal.groupby("run_id"):
        L = int(g.n_layer.iloc[0])
        assert sorted(g.k.unique()) == list(range(L)), run_id  # the full model, then k = 1 .. L - 1
        assert (g.loc[g.k == 0, "change"] == 0).all() and (g.full_loss > 0).all()
    depth = pd.read_parquet(root / "results/tables/effective_depth.parquet")
    assert set(depth.run_id) == ok and depth.effective_fraction.between(0, 1).all()
    assert {"arch", "n_layer", "is_best_lr"} <= set(depth.columns)


def test_nll_and_cost_tables(workflow):
    root = workflow[0]
    runs = pd.read_parquet(root / "results/tables/runs.parquet")
    nll = pd.read_parquet(root / "results/tables/nll.parquet")
    assert set(nll.run_id) == set(runs.run_id)
    sets = nll[nll.level == "set"]
    assert len(sets) == (SWEEP + REPLICATES) * 3 and set(sets.set) == {"humaneval", "sciq", "gsm8k"}
    assert set(sets.n_docs) == {6} and set(sets.groupby("set").n_docs_source.first()) == {
        164,
        1000,
        1319,
    }
    domains = nll[nll.level == "domain"]
    assert set(domains.domain) == {"code", "stem", "math"}
    ok = nll[(nll.status == "ok")]
    assert ok.bits_per_byte.notna().all() and (ok.bits_per_byte > 0).all()
    assert nll[nll.status == "diverged"].bits_per_byte.isna().all()
    assert {"arch", "n_layer", "lr", "is_best_lr", "ratio"} <= set(nll.columns)
    cost = pd.read_parquet(root / "results/tables/cost.parquet")
    assert (
        len(cost) == SWEEP + REPLICATES
        and (cost.params_total == cost.params_embedding + cost.params_non_embedding).all()
    )
    assert (cost.prefill_flops_4096 > 0).all() and (cost.kv_cache_bytes_per_token > 0).all()
    assert (cost.step_seconds > 0).all() and set(cost.peak_memory_kind) == {"process_max_rss"}
    for stem in ("nll_vs_ratio", "cost_vs_ratio", "loss_vs_cost"):
        assert (root / f"results/figures/{stem}.png").stat().st_size > 10_000
        assert (root / f"results/figures/{stem}.pdf").read_bytes()[:5] == b"%PDF-"


def test_report_and_claims_hold_every_figure_with_its_caption(workflow):
    root = workflow[0]
    html = (root / "results/report.html").read_text()
    for (
        name
    ) in FIGURES:  # every figure embedded as a PNG data URI with its caption: one offline file
        assert (
            f'<figure id="{name}"><img alt="{name}" src="data:image/png;base64,iVBORw0KGgo' in html
        ), name
    assert html.count("<figcaption>") == len(FIGURES) and "Config <tt>tiny</tt>" in html
    first = html.split('<h2 id="s0">')[0]  # what opens first: headline, best-LR and claims tables
    assert (
        first.count("data:image/png") == 1
        and "Best learning rate per shape" in first
        and "Layer profile" in first
    )
    claims = pd.read_parquet(root / "results/tables/claims.parquet")
    assert (
        len(claims) >= 12
        and claims["verdict"]
        .str.match(r"holds|contradicted|inconclusive at this scale|not testable in this grid: .+")
        .all()
    )
    by_id = claims.set_index("claim_id")
    assert (
        by_id.loc["g_cost_grows_with_depth", "verdict"] == "holds"
    )  # analytic: deeper at a fixed budget costs more
    assert by_id.loc["f_mhc_rank_below_hc", "verdict"].startswith(
        "not testable"
    )  # no hc/mhc in this grid
    # the first screen shows the testable claims and counts the rest; all of them are in full below
    assert "<b>(g)</b>" in first and "<b>(f)</b>" not in first and "<b>(f)</b>" in html
    assert (
        f"{int(claims['verdict'].str.startswith('not testable').sum())} "
        "more not testable in this grid" in first
    )
    snakemake(
        root, "--report", "results/provenance.html"
    )  # Snakemake's provenance view still works


def test_regenerate_rebuilds_figures_without_training(workflow, tmp_path):
    """In a fresh copy that has only the results/ folder (no tables, no figures, no report, no
    work folders, no Snakemake metadata), `depthbench regenerate` rebuilds every table, figure and
    the report, and no training, probing or scoring job runs. (A copy with only the figures
    deleted is the easier case of the same: the tables are then up to date and kept.)"""
    root = workflow[0]
    (tmp_path / "laptop").mkdir()
    laptop = copy_workflow(tmp_path / "laptop")
    shutil.copytree(
        root / "results",
        laptop / "results",
        ignore=shutil.ignore_patterns("*.bin", "work", "figures", "tables", "report.html"),
    )
    shutil.copy(root / "config/config.yaml", laptop / "config/config.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "depthbench.commands.cli", "regenerate"],
        cwd=laptop,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rule in ("rule train:", "rule probe:", "rule nll:", "rule tokenize:"):
        assert rule not in proc.stdout + proc.stderr
    for name in FIGURES:
        assert (laptop / f"results/figures/{name}.png").exists(), name
    assert (laptop / "results/report.html").stat().st_size > 100_000
    assert len(pd.read_parquet(laptop / "results/tables/runs.parquet")) == SWEEP + REPLICATES


def test_probe_setting_reruns_probes_only(workflow, wiki_jsonl):
    root = workflow[0]
    with edited_config(root, replicated(wiki_jsonl, probes={"n_sequences": 4})):
        plan = snakemake(root, "-n")
    assert job_counts(plan.stdout + plan.stderr) == {
        "all": 1,
        "probe": SWEEP + REPLICATES,
        "probes_table": 1,
        "probe_figures": 1,
        "claims": 1,
        "report": 1,
        "removal": SWEEP + REPLICATES,
        "removal_table": 1,
        "figures": 1,
        "total": 7 + 2 * (SWEEP + REPLICATES),
    }  # the headline's removal panel


def test_second_run_plans_nothing_and_says_so(workflow):
    """After a complete run, Snakemake plans no job (a dry run: what it plans is what it would
    run)."""
    root = workflow[0]
    proc = snakemake(root, "-n")
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_figure_setting_reruns_only_figures(workflow, wiki_jsonl):
    root = workflow[0]
    with edited_config(
        root, replicated(wiki_jsonl, figures={"dpi": 80})
    ):  # (test_regenerate... draws them for real)
        plan = snakemake(root, "-n")
    assert job_counts(plan.stdout + plan.stderr) == {
        "all": 1,
        "figures": 1,
        "probe_figures": 1,
        "dynamics_figure": 1,
        "cost_figures": 1,
        "nll_figures": 1,
        "claims": 1,
        "report": 1,
        "total": 8,
    }


def test_operational_settings_do_not_retrain(workflow, wiki_jsonl):
    root = workflow[0]
    config = replicated(wiki_jsonl)
    config["train"].update(checkpoint_every=1000, log_every=5, threads=2, loggers=["tensorboard"])
    config["launcher"] = {"backend": "local"}
    with edited_config(root, config):
        plan = snakemake(root, "-n")
    assert "Nothing to be done" in plan.stdout + plan.stderr


def test_adding_a_learning_rate_trains_only_the_new_runs(workflow, wiki_jsonl):
    """The sweep alone (seeds_at_best_lr: 1): the new LR's 4 runs train and are evaluated, the
    aggregates redo. Replicated: the same 4 train and the lr_sweep checkpoint reruns; which
    replicates and evaluations follow is decided by the checkpoint, after the plan."""
    root = workflow[0]
    lrs = [3e-3, 50.0, 1e-2]
    with edited_config(root, replicated(wiki_jsonl, learning_rates=lrs, seeds_at_best_lr=1)):
        plan = snakemake(root, "-n")
    aggregates = {
        "all": 1,
        "figures": 1,
        "tables": 1,
        "probes_table": 1,
        "probe_figures": 1,
        "dynamics_figure": 1,
        "nll_table": 1,
        "cost_table": 1,
        "cost_figures": 1,
        "nll_figures": 1,
        "claims": 1,
        "report": 1,
        "removal_table": 1,
    }
    assert job_counts(plan.stdout + plan.stderr) == {
        **aggregates,
        "train": 4,
        "probe": 4,
        "nll": 4,
        "removal": 4,
        "total": 29,
    }
    with edited_config(root, replicated(wiki_jsonl, learning_rates=lrs)):
        plan = snakemake(root, "-n")
    assert job_counts(plan.stdout + plan.stderr) == {
        **aggregates,
        "train": 4,
        "lr_sweep": 1,
        "total": 18,
    }


@pytest.mark.parametrize("seeds_at_best_lr", [1, 2], ids=["sweep_only", "replicated"])
def test_best_lr_evaluation_probes_and_scores_only_the_best_runs(
    workflow, wiki_jsonl, tmp_path, seeds_at_best_lr
):
    """probes.runs / nll.runs: best_lr: nothing retrains, and the tables then hold the runs that a
    hand selection from runs.parquet picks: every finished run at the LR of lowest mean final loss
    per cell. On the sweep alone (no replicates: the choice is read from the tables checkpoint)
    one run per cell; replicated (read from the lr_sweep checkpoint) both seeds of that LR."""
    # in a copy (results and Snakemake's metadata, mtimes kept): the shared workflow stays as it is
    root = shutil.copytree(
        workflow[0], tmp_path / "best_lr", symlinks=True, ignore=shutil.ignore_patterns("work")
    )
    config = replicated(wiki_jsonl, seeds_at_best_lr=seeds_at_best_lr)
    config["probes"] = {"runs": "best_lr"}
    config["nll"] = {**config["nll"], "runs": "best_lr"}
    write_config(root, config)
    proc = snakemake(root, "--until", "probes_table", "nll_table", "removal_table")
    assert job_counts(proc.stdout + proc.stderr).get("train", 0) == 0
    runs = pd.read_parquet(root / "results/tables/runs.parquet")
    assert len(runs) == (SWEEP if seeds_at_best_lr == 1 else SWEEP + REPLICATES)
    ok = runs[runs.status == "ok"]
    means = ok.groupby(["arch", "n_layer", "lr"], as_index=False)["final_val_loss"].mean()
    best_lr = means.loc[means.groupby(["arch", "n_layer"])["final_val_loss"].idxmin()]
    best = ok.merge(best_lr[["arch", "n_layer", "lr"]], on=["arch", "n_layer", "lr"]).run_id
    assert len(best) == 4 * seeds_at_best_lr
    for table in ("probes", "nll", "removal"):
        assert set(pd.read_parquet(root / f"results/tables/{table}.parquet").run_id) == set(best), (
            table
        )


def test_seeds_at_best_lr_trains_replicates_of_the_best_lr_only_after_the_sweep(workflow):
    """seeds_at_best_lr: 2: the plan before any training holds the sweep's runs only and the
    lr_sweep checkpoint; once the checkpoint has read the sweep, exactly one replicate (seed 1)
    per cell trains, at the LR that did not diverge, and best_lr.parquet has n = 2 with an
    interval per cell."""
    root, first = workflow
    log = first.stdout + first.stderr
    planned = job_counts(log)  # the first Job stats: the plan before any job ran
    assert planned.get("lr_sweep") == 1 and planned.get("train") == SWEEP, planned
    trains = [m.start() for m in re.finditer(r"^(?:local)?rule train:", log, re.M)]
    (sweep_read,) = [m.start() for m in re.finditer(r"^(?:local)?checkpoint lr_sweep:", log, re.M)]
    assert len(trains) == SWEEP + REPLICATES
    assert sum(t > sweep_read for t in trains) == REPLICATES  # started after the checkpoint
    runs = pd.read_parquet(root / "results/tables/runs.parquet")
    replicas = runs[runs.seed == 1]
    assert set(replicas.lr) == {3e-3} and len(replicas) == REPLICATES
    best = pd.read_parquet(root / "results/tables/best_lr.parquet")
    assert len(best) == 4 and set(best.n) == {2} and set(best.best_lr) == {3e-3}
    assert (best.ci_low < best.final_val_loss).all() and (best.final_val_loss < best.ci_high).all()
    sweep = pd.read_parquet(root / "results/tables/lr_sweep/round0.parquet")  # no extensions
    assert sweep.settled.all() and sorted(
        r for ids in sweep.replicate_run_ids for r in ids
    ) == sorted(replicas.run_id)


def test_invalid_config_fails_before_any_job(workflow, wiki_jsonl, tmp_path):
    root = workflow[0]
    bad = replicated(wiki_jsonl, shapes=[{"n_layer": 2, "d_model": 50}])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    before = sorted(p for p in (root / "results").rglob("*"))
    proc = snakemake(root, "--configfile", str(path), check=False)
    assert proc.returncode != 0
    assert "shapes[0].d_model" in proc.stderr + proc.stdout
    assert sorted(p for p in (root / "results").rglob("*")) == before
