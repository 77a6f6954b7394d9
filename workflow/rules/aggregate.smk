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
    log:
        f"{RESULTS}/logs/tables.log",
    benchmark:
        f"{RESULTS}/benchmarks/tables.tsv"
    script:
        "../../scripts/tables.py"
