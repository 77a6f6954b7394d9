# Figures read only the tables: changing a figure setting re-runs these rules, nothing else.


rule figures:
    input:
        runs=rules.tables.output.runs,
        curves=rules.tables.output.curves,
        best_lr=rules.tables.output.best_lr,
    output:
        **figure_outputs(["headline", "loss_vs_lr", "loss_curves"], "1. Loss"),
    params:
        figures=config["figures"],
        experiment=EXPERIMENT,
    log:
        f"{RESULTS}/logs/figures.log",
    benchmark:
        f"{RESULTS}/benchmarks/figures.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/figures.py"


# Training dynamics (only when the config logs them: train.dynamics_every > 0).
rule dynamics_figure:
    input:
        dynamics=rules.tables.output.dynamics,
        runs=rules.tables.output.runs,
        best_lr=rules.tables.output.best_lr,
    output:
        **figure_outputs(["dynamics"], "3. Training dynamics"),
    params:
        figures=config["figures"],
        experiment=EXPERIMENT,
    log:
        f"{RESULTS}/logs/dynamics_figure.log",
    benchmark:
        f"{RESULTS}/benchmarks/dynamics_figure.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/dynamics_figure.py"


# NLL on coding, STEM and math, and the cost of each shape (cost figures need no NLL).
COST_FIGURES = ["cost_vs_ratio", "loss_vs_cost"] + (["nll_vs_ratio"] if config["nll"]["enabled"] else [])


rule cost_figures:
    input:
        cost=rules.cost_table.output[0],
        nll=rules.nll_table.output[0] if config["nll"]["enabled"] else [],
    output:
        **figure_outputs(COST_FIGURES, "4. NLL and cost"),
    params:
        figures=config["figures"],
        experiment=EXPERIMENT,
    log:
        f"{RESULTS}/logs/cost_figures.log",
    benchmark:
        f"{RESULTS}/benchmarks/cost_figures.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/cost_figures.py"
