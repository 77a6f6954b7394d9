# Figures read only the tables: changing a figure setting re-runs these rules, nothing else.


rule figures:
    input:
        runs=rules.tables.output.runs,
        curves=rules.tables.output.curves,
        best_lr=rules.tables.output.best_lr,
    output:
        headline_png=f"{RESULTS}/figures/headline.png",
        headline_pdf=f"{RESULTS}/figures/headline.pdf",
        lr_png=f"{RESULTS}/figures/loss_vs_lr.png",
        lr_pdf=f"{RESULTS}/figures/loss_vs_lr.pdf",
        curves_png=f"{RESULTS}/figures/loss_curves.png",
        curves_pdf=f"{RESULTS}/figures/loss_curves.pdf",
    params:
        figures=config["figures"],
        experiment=EXPERIMENT,
    log:
        f"{RESULTS}/logs/figures.log",
    benchmark:
        f"{RESULTS}/benchmarks/figures.tsv"
    script:
        "../../scripts/figures.py"


# Training dynamics (only when the config logs them: train.dynamics_every > 0).
rule dynamics_figure:
    input:
        dynamics=rules.tables.output.dynamics,
        runs=rules.tables.output.runs,
        best_lr=rules.tables.output.best_lr,
    output:
        png=f"{RESULTS}/figures/dynamics.png",
        pdf=f"{RESULTS}/figures/dynamics.pdf",
    params:
        figures=config["figures"],
        experiment=EXPERIMENT,
    log:
        f"{RESULTS}/logs/dynamics_figure.log",
    benchmark:
        f"{RESULTS}/benchmarks/dynamics_figure.tsv"
    script:
        "../../scripts/dynamics_figure.py"
