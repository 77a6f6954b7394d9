# Parquet tables from run outputs only: one row per run, the loss curves, the best LR.

# The grid's identity of each run (RunSpec.spec_hash): the tables refuse a summary.json that
# belongs to another run or to an older version of this grid, naming the file.
SPEC_HASHES = {run_id: spec.spec_hash() for run_id, spec in ALL_RUNS.items()}


if SWEEP_ROUNDS:

    # A checkpoint, one job per round: the LR sweep's best LR per cell (chosen on the sweep's
    # seeds), the LR past an edge it calls for (lr_sweep.max_extensions) and, for the cells it
    # settles, the replicates of seeds_at_best_lr (depthbench.analysis.lr_rounds). Round 0 reads
    # the grid's runs, round k those and the extensions round k-1 listed; sweep_round_inputs and
    # last_sweep_round (common.smk) read the rounds' tables.
    checkpoint lr_sweep:
        input:
            summaries=sweep_round_inputs,
            data=f"{DATA_DIR}/meta.json",
        output:
            sweep=f"{RESULTS}/tables/lr_sweep/round{{round}}.parquet",
        params:
            experiment=EXPERIMENT,
            spec_hashes={run_id: SPEC_HASHES[run_id] for run_id in SWEEP_RUNS},
            budget_params=config.get("budget", {}).get("params"),
            learned_margin=config["analysis"]["learned_margin"],
            ladders=LADDERS,
            max_extensions=MAX_EXTENSIONS,
            replicates={run_id: list(replicas) for run_id, replicas in EXP.replicates.items()},
        log:
            f"{RESULTS}/logs/lr_sweep/round{{round}}.log",
        benchmark:
            f"{RESULTS}/benchmarks/lr_sweep/round{{round}}.tsv"
        conda:
            "../../envs/depthbench.yaml"
        script:
            "../../scripts/lr_sweep.py"


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
        spec_hashes=SPEC_HASHES,  # each summary.json must match its run's identity
        sweep_seeds=config["seeds"],  # the best LR is chosen on these (replicates: seeds_at_best_lr)
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
