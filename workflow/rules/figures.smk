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
