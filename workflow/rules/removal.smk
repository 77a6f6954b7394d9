# Layer removal: one job per probed run, dispatched through submitit like the probes. Rankings
# come from the run's probe rows; the losses from validation windows held apart from the probe
# sample and from the NLL stage's documents. Removal settings are params of these rules only.

REMOVAL_SETTINGS = {k: v for k, v in config["removal"].items() if k not in ("enabled", "tolerance")}
# which windows the probe sample took, so that the removal losses use others
REMOVAL_PROBE_SAMPLE = {k: config["probes"][k] for k in ("n_sequences", "seed", "seq_len")}


rule removal:
    input:
        summary=f"{RESULTS}/runs/{{run_id}}/summary.json",
        weights=f"{RESULTS}/runs/{{run_id}}/model.safetensors",
        probes=f"{RESULTS}/probes/{{run_id}}.parquet",
        data=f"{DATA_DIR}/meta.json",
        sets=rules.nll_sets.output[0],
    output:
        f"{RESULTS}/removal/{{run_id}}.parquet",
    params:
        spec=lambda wc: ALL_RUNS[wc.run_id].identity_dict(),
        settings=REMOVAL_SETTINGS,
        probe_settings=REMOVAL_PROBE_SAMPLE,
        data_dir=DATA_DIR,
        run_dir=lambda wc: f"{RESULTS}/runs/{wc.run_id}",
        work_dir=lambda wc: f"{RESULTS}/work/{wc.run_id}",
    threads: train_threads
    resources:
        dispatch_slots=1,
    log:
        f"{RESULTS}/logs/removal/{{run_id}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/removal/{{run_id}}.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/removal.py"


rule removal_table:
    input:
        removal=lambda wc: [f"{RESULTS}/removal/{run_id}.parquet" for run_id in evaluated_runs("probes")(wc)]
        + pretrained_outputs("removal.parquet"),
        runs=rules.tables.output.runs,
        best_lr=rules.tables.output.best_lr,
    output:
        removal=f"{RESULTS}/tables/removal.parquet",
        effective_depth=f"{RESULTS}/tables/effective_depth.parquet",
    params:
        tolerance=config["removal"]["tolerance"],
    log:
        f"{RESULTS}/logs/removal_table.log",
    benchmark:
        f"{RESULTS}/benchmarks/removal_table.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/removal_table.py"
