# Teacher-forced NLL on coding, STEM and math sets: the sets are tokenized once per tokenizer,
# each run is scored by a job dispatched through submitit like training, and the per-run rows
# are merged with the runs' config columns. NLL settings are params of these rules only.

from depthbench.evals.sets import sets_settings, sets_table_path

NLL_SETTINGS = sets_settings(config["nll"])


rule nll_sets:
    input:
        tokenizer=TOKENIZER,
    output:
        sets_table_path(RESULTS, EXP.tokenizer_id, config["nll"]),
    params:
        settings=NLL_SETTINGS,
        eos_token=config["tokenizer"].get("eos_token"),
    log:
        f"{RESULTS}/logs/nll_sets/{EXP.tokenizer_id}.log",
    benchmark:
        f"{RESULTS}/benchmarks/nll_sets/{EXP.tokenizer_id}.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/nll_sets.py"


rule nll:
    input:
        summary=f"{RESULTS}/runs/{{run_id}}/summary.json",
        weights=f"{RESULTS}/runs/{{run_id}}/model.safetensors",
        sets=rules.nll_sets.output[0],
    output:
        f"{RESULTS}/nll/{{run_id}}.parquet",
    params:
        spec=lambda wc: ALL_RUNS[wc.run_id].identity_dict(),
        settings=NLL_SETTINGS,  # tokens_per_batch is operational: read from the config by the script
        run_dir=lambda wc: f"{RESULTS}/runs/{wc.run_id}",
        work_dir=lambda wc: f"{RESULTS}/work/{wc.run_id}",
    threads: train_threads
    resources:
        dispatch_slots=1,
    log:
        f"{RESULTS}/logs/nll/{{run_id}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/nll/{{run_id}}.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/nll.py"


rule nll_table:
    input:
        nll=lambda wc: [f"{RESULTS}/nll/{run_id}.parquet" for run_id in evaluated_runs("nll")(wc)]
        + pretrained_outputs("nll.parquet"),
        runs=rules.tables.output.runs,
        best_lr=rules.tables.output.best_lr,
    output:
        f"{RESULTS}/tables/nll.parquet",
    log:
        f"{RESULTS}/logs/nll_table.log",
    benchmark:
        f"{RESULTS}/benchmarks/nll_table.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/nll_table.py"
