# Figures, claims and the report read only the tables: changing a figure setting re-runs these
# rules, nothing else. Which figures a grid gets, and which tables each reads, comes from the
# figure registry (depthbench/analysis/registry.py), which also drops the figures of a stage the
# config turns off; the figure rules share one script.

rule figures:
    input:
        **figure_inputs("figures"),
    output:
        **figure_outputs("figures"),
    params:
        names=of_rule(GRID_FIGURES, "figures"),
        settings=FIGURE_SETTINGS,
    log:
        f"{RESULTS}/logs/figures.log",
    benchmark:
        f"{RESULTS}/benchmarks/figures.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/figures.py"


use rule figures as probe_figures with:
    input:
        **figure_inputs("probe_figures"),
    output:
        **figure_outputs("probe_figures"),
    params:
        names=of_rule(GRID_FIGURES, "probe_figures"),
        settings=FIGURE_SETTINGS,
    log:
        f"{RESULTS}/logs/probe_figures.log",
    benchmark:
        f"{RESULTS}/benchmarks/probe_figures.tsv"


# Training dynamics (only when the config logs them: train.dynamics_every > 0).
use rule figures as dynamics_figure with:
    input:
        **figure_inputs("dynamics_figure"),
    output:
        **figure_outputs("dynamics_figure"),
    params:
        names=of_rule(GRID_FIGURES, "dynamics_figure"),
        settings=FIGURE_SETTINGS,
    log:
        f"{RESULTS}/logs/dynamics_figure.log",
    benchmark:
        f"{RESULTS}/benchmarks/dynamics_figure.tsv"


use rule figures as nll_figures with:
    input:
        **figure_inputs("nll_figures"),
    output:
        **figure_outputs("nll_figures"),
    params:
        names=of_rule(GRID_FIGURES, "nll_figures"),
        settings=FIGURE_SETTINGS,
    log:
        f"{RESULTS}/logs/nll_figures.log",
    benchmark:
        f"{RESULTS}/benchmarks/nll_figures.tsv"


use rule figures as cost_figures with:
    input:
        **figure_inputs("cost_figures"),
    output:
        **figure_outputs("cost_figures"),
    params:
        names=of_rule(GRID_FIGURES, "cost_figures"),
        settings=FIGURE_SETTINGS,
    log:
        f"{RESULTS}/logs/cost_figures.log",
    benchmark:
        f"{RESULTS}/benchmarks/cost_figures.tsv"


# The claims of the source papers, each with our number and a verdict (config/claims.yaml).
CLAIM_TABLES = ["runs", "best_lr", "curves", "cost"] + (["dynamics"] if config["train"]["dynamics_every"] > 0 else []) + (
    ["probes"] if config["probes"]["enabled"] else []) + (["nll"] if config["nll"]["enabled"] else []) + (
    ["effective_depth"] if REMOVAL_ON else [])


rule claims:
    input:
        claims="config/claims.yaml",
        **{t: f"{RESULTS}/tables/{t}.parquet" for t in CLAIM_TABLES},
    output:
        f"{RESULTS}/tables/claims.parquet",
    params:
        settings={**FIGURE_SETTINGS, "analysis": config["analysis"]},  # analysis: the learned margin
    log:
        f"{RESULTS}/logs/claims.log",
    benchmark:
        f"{RESULTS}/benchmarks/claims.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/claims.py"


# The report: one offline HTML file that opens on the headline, the claims and the best LRs.
rule report:
    input:
        claims=rules.claims.output[0],
        runs=rules.tables.output.runs,
        best_lr=rules.tables.output.best_lr,
        **({"probes": f"{RESULTS}/tables/probes.parquet"} if config["probes"]["enabled"] else {}),
        **({"effective_depth": f"{RESULTS}/tables/effective_depth.parquet"} if REMOVAL_ON else {}),
        figures=[f"{RESULTS}/figures/{name}.png" for name in GRID_FIGURES],
    output:
        f"{RESULTS}/report.html",
    params:
        names=GRID_FIGURES,
        settings=FIGURE_SETTINGS,
    log:
        f"{RESULTS}/logs/report.log",
    benchmark:
        f"{RESULTS}/benchmarks/report.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/report.py"
