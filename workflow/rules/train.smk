# One job per run of the grid. The job dispatches training through submitit (inline, local or
# SLURM, from config['launcher']) and waits. Checkpoints live in results/work/{run_id}, which
# is not an output, so a failed or killed job resumes where it stopped when run again.
# With probes.at_steps the run also keeps its weights at those steps: the folder `snapshots` is
# then an output (depthbench.train.snapshots), and the steps a param, so changing them retrains.
from depthbench.train.snapshots import resolve_steps

AT_STEPS = config["probes"]["at_steps"] if config["probes"]["enabled"] else []


def snapshot_steps(wildcards):
    return resolve_steps(AT_STEPS, ALL_RUNS[wildcards.run_id].train.total_steps)


SNAPSHOTS = f"{RESULTS}/runs/{{run_id}}/snapshots"


rule train:
    input:
        data=f"{DATA_DIR}/meta.json",
    output:
        summary=f"{RESULTS}/runs/{{run_id}}/summary.json",
        weights=f"{RESULTS}/runs/{{run_id}}/model.safetensors",
        metrics=f"{RESULTS}/runs/{{run_id}}/metrics.jsonl",
        **({"snapshots": directory(SNAPSHOTS)} if AT_STEPS else {}),
    params:
        # the run's identity only: operational settings are read from the config by the script
        spec=lambda wc: ALL_RUNS[wc.run_id].identity_dict(),
        data_dir=DATA_DIR,
        run_dir=lambda wc: f"{RESULTS}/runs/{wc.run_id}",
        work_dir=lambda wc: f"{RESULTS}/work/{wc.run_id}",
        **({"snapshot_steps": snapshot_steps} if AT_STEPS else {}),  # absent when off: no rerun of old runs
    threads: train_threads
    resources:
        dispatch_slots=1,
        # What each submitted job asks SLURM for (informative here: SLURM, not Snakemake,
        # allocates them; 0 when training runs on this machine).
        nodes=slurm_request("nodes"),
        gpus_per_node=slurm_request("gpus_per_node"),
        ranks=RANKS_PER_RUN,  # torch.distributed ranks of one run (one task per GPU on SLURM)
    log:
        f"{RESULTS}/logs/train/{{run_id}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/train/{{run_id}}.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/train.py"
