# Parquet tables from run outputs only: one row per run, the loss curves, the best LR.

# The grid's identity of each run (RunSpec.spec_hash): the tables refuse a summary.json that
# belongs to another run or to an older version of this grid, naming the file.
SPEC_HASHES = {run_id: spec.spec_hash() for run_id, spec in RUNS.items()}


# A checkpoint: with `probes.runs: best_lr` or `nll.runs: best_lr` the probe and NLL jobs are
# chosen from its best_lr table once training is done (evaluated_runs in common.smk).
checkpoint tables:
    input:
        summaries=run_outputs("summary.json"),
        metrics=run_outputs("metrics.jsonl"),
        data=f"{DATA_DIR}/meta.json",
        pretrained=pretrained_outputs("summary.json"),
    output:
        runs=f"{RESULTS}/tables/runs.parquet",
        curves=f"{RESULTS}/tables/curves.parquet",
        best_lr=f"{RESULTS}/tables/best_lr.parquet",
        dynamics=f"{RESULTS}/tables/dynamics.parquet",
    params:
        experiment=EXPERIMENT,
        run_ids=list(RUNS),
        spec_hashes=SPEC_HASHES,  # each summary.json must match its run's identity
        budget_params=config.get("budget", {}).get("params"),
        learned_margin=config["analysis"]["learned_margin"],  # runs.parquet `learned`
    log:
        f"{RESULTS}/logs/tables.log",
    benchmark:
        f"{RESULTS}/benchmarks/tables.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/tables.py"


# Cost accounting: analytic (from each run's spec) and measured (from its summary).
rule cost_table:
    input:
        summaries=run_outputs("summary.json"),
        pretrained=pretrained_outputs("summary.json"),
        runs=rules.tables.output.runs,
        best_lr=rules.tables.output.best_lr,
    output:
        f"{RESULTS}/tables/cost.parquet",
    params:
        spec_hashes=SPEC_HASHES,
        seq_len=config["train"]["seq_len"],  # pretrained models are costed at the grid's length
    log:
        f"{RESULTS}/logs/cost_table.log",
    benchmark:
        f"{RESULTS}/benchmarks/cost_table.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/cost_table.py"
