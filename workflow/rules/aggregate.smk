# Parquet tables from run outputs only: one row per run, the loss curves, the best LR.


rule tables:
    input:
        summaries=run_outputs("summary.json"),
        metrics=run_outputs("metrics.jsonl"),
        data=f"{DATA_DIR}/meta.json",
    output:
        runs=f"{RESULTS}/tables/runs.parquet",
        curves=f"{RESULTS}/tables/curves.parquet",
        best_lr=f"{RESULTS}/tables/best_lr.parquet",
        dynamics=f"{RESULTS}/tables/dynamics.parquet",
    params:
        experiment=EXPERIMENT,
        run_ids=list(RUNS),
        budget_params=config.get("budget", {}).get("params"),
    log:
        f"{RESULTS}/logs/tables.log",
    benchmark:
        f"{RESULTS}/benchmarks/tables.tsv"
    script:
        "../../scripts/tables.py"


# Cost accounting: analytic (from each run's spec) and measured (from its summary).
rule cost_table:
    input:
        summaries=run_outputs("summary.json"),
        runs=rules.tables.output.runs,
        best_lr=rules.tables.output.best_lr,
    output:
        f"{RESULTS}/tables/cost.parquet",
    log:
        f"{RESULTS}/logs/cost_table.log",
    benchmark:
        f"{RESULTS}/benchmarks/cost_table.tsv"
    script:
        "../../scripts/cost_table.py"
