# Pretrained checkpoints (config `pretrained`) as runs with status 'pretrained': no training.
# A GGUF is dequantized once into an hf folder; each run gets a summary (family, shape,
# parameters) for the runs table, a probe sample of the corpus's validation text tokenized with
# its own tokenizer, its probe rows and its NLL rows, merged into the tables beside trained runs.
# Logic in depthbench.pretrained; the scripts only pass paths and settings.

from depthbench.pretrained.loading import pretrained_specs

PRETRAINED = pretrained_specs(config)
PRETRAINED_DIR = f"{RESULTS}/pretrained"
# probe sample and NLL window: the grid's training sequence length unless the stage sets its own,
# so that pretrained and trained runs are measured on windows of the same length
PRETRAINED_PROBE_LEN = config["probes"]["seq_len"] or config["train"]["seq_len"]
PRETRAINED_NLL_LEN = config["nll"]["seq_len"] or config["train"]["seq_len"]


def pretrained_outputs(name):
    return [f"{PRETRAINED_DIR}/{run_id}/{name}" for run_id in PRETRAINED]


def pretrained_model_dir(wildcards):
    """The hf folder a stage loads: the converted one for GGUF, the configured one for hf."""
    spec = PRETRAINED[wildcards.run_id]
    return f"{PRETRAINED_DIR}/{wildcards.run_id}/model" if spec.format == "gguf" else spec.source()


def pretrained_model_input(wildcards):
    return [f"{PRETRAINED_DIR}/{wildcards.run_id}/model"] if PRETRAINED[wildcards.run_id].format == "gguf" else []


rule pretrained_convert:
    output:
        directory(f"{PRETRAINED_DIR}/{{run_id}}/model"),
    params:
        spec=lambda wc: PRETRAINED[wc.run_id],
    log:
        f"{RESULTS}/logs/pretrained/{{run_id}}/convert.log",
    benchmark:
        f"{RESULTS}/benchmarks/pretrained/{{run_id}}/convert.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/pretrained.py"


rule pretrained_summary:
    input:
        pretrained_model_input,
    output:
        f"{PRETRAINED_DIR}/{{run_id}}/summary.json",
    params:
        spec=lambda wc: PRETRAINED[wc.run_id],
        model_dir=pretrained_model_dir,
        fields=2,  # 2: with the cost fields (depthbench.pretrained.stages.cost_fields); a change reruns it
    log:
        f"{RESULTS}/logs/pretrained/{{run_id}}/summary.log",
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/pretrained.py"


rule pretrained_sample:
    input:
        pretrained_model_input,
    output:
        f"{PRETRAINED_DIR}/{{run_id}}/probe_sample.npy",
    params:
        spec=lambda wc: PRETRAINED[wc.run_id],
        model_dir=pretrained_model_dir,
        corpus=config["corpus"],
        settings={k: v for k, v in config["probes"].items() if k not in ("enabled", "runs")},
        seq_len=PRETRAINED_PROBE_LEN,
    log:
        f"{RESULTS}/logs/pretrained/{{run_id}}/sample.log",
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/pretrained.py"


rule pretrained_probe:
    input:
        model=pretrained_model_input,
        sample=f"{PRETRAINED_DIR}/{{run_id}}/probe_sample.npy",
    output:
        f"{PRETRAINED_DIR}/{{run_id}}/probes.parquet",
    params:
        spec=lambda wc: PRETRAINED[wc.run_id],
        model_dir=pretrained_model_dir,
        settings={k: v for k, v in config["probes"].items() if k not in ("enabled", "runs")},
    threads: lambda wc: config["train"]["threads"]
    log:
        f"{RESULTS}/logs/pretrained/{{run_id}}/probe.log",
    benchmark:
        f"{RESULTS}/benchmarks/pretrained/{{run_id}}/probe.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/pretrained.py"


rule pretrained_nll:
    input:
        pretrained_model_input,
    output:
        f"{PRETRAINED_DIR}/{{run_id}}/nll.parquet",
    params:
        spec=lambda wc: PRETRAINED[wc.run_id],
        model_dir=pretrained_model_dir,
        settings={k: v for k, v in config["nll"].items() if k not in ("enabled", "runs")},
        window=PRETRAINED_NLL_LEN,
    threads: lambda wc: config["train"]["threads"]
    log:
        f"{RESULTS}/logs/pretrained/{{run_id}}/nll.log",
    benchmark:
        f"{RESULTS}/benchmarks/pretrained/{{run_id}}/nll.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/pretrained.py"


rule pretrained_removal:
    input:
        model=pretrained_model_input,
        probes=f"{PRETRAINED_DIR}/{{run_id}}/probes.parquet",
    output:
        f"{PRETRAINED_DIR}/{{run_id}}/removal.parquet",
    params:
        spec=lambda wc: PRETRAINED[wc.run_id],
        model_dir=pretrained_model_dir,
        corpus=config["corpus"],
        settings={k: v for k, v in config["removal"].items() if k not in ("enabled", "tolerance")},
        probe_settings={k: config["probes"][k] for k in ("n_sequences", "seed")},
        nll_settings={k: v for k, v in config["nll"].items() if k not in ("enabled", "runs")},
        seq_len=PRETRAINED_PROBE_LEN,
    threads: lambda wc: config["train"]["threads"]
    log:
        f"{RESULTS}/logs/pretrained/{{run_id}}/removal.log",
    benchmark:
        f"{RESULTS}/benchmarks/pretrained/{{run_id}}/removal.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/pretrained.py"
