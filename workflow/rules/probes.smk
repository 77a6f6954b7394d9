# Layer-utilization probes: one job per run, dispatched through submitit like training, one
# Parquet file per run, merged with the runs' config columns. Probe settings are params of these
# rules only: changing them re-runs the probes, never training.


rule probe:
    input:
        summary=f"{RESULTS}/runs/{{run_id}}/summary.json",
        weights=f"{RESULTS}/runs/{{run_id}}/model.safetensors",
        data=f"{DATA_DIR}/meta.json",
        **({"snapshots": SNAPSHOTS} if AT_STEPS else {}),  # probed too, rows of stage 'snapshot'
    output:
        f"{RESULTS}/probes/{{run_id}}.parquet",
    params:
        spec=lambda wc: ALL_RUNS[wc.run_id].identity_dict(),
        # at_steps only when on, so that probe files made before it existed are not redone
        settings={k: v for k, v in config["probes"].items() if k not in ("enabled", "runs") and (k != "at_steps" or v)},
        data_dir=DATA_DIR,
        run_dir=lambda wc: f"{RESULTS}/runs/{wc.run_id}",
        work_dir=lambda wc: f"{RESULTS}/work/{wc.run_id}",
    threads: train_threads
    resources:
        dispatch_slots=1,
    log:
        f"{RESULTS}/logs/probe/{{run_id}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/probe/{{run_id}}.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/probe.py"


rule probes_table:
    input:
        probes=lambda wc: [f"{RESULTS}/probes/{run_id}.parquet" for run_id in evaluated_runs("probes")(wc)]
        + pretrained_outputs("probes.parquet"),
        runs=rules.tables.output.runs,
        best_lr=rules.tables.output.best_lr,
    output:
        probes=f"{RESULTS}/tables/probes.parquet",
        lens=f"{RESULTS}/tables/logit_lens.parquet",
    log:
        f"{RESULTS}/logs/probes_table.log",
    benchmark:
        f"{RESULTS}/benchmarks/probes_table.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/probes_table.py"
