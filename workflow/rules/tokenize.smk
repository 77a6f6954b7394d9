# Tokenizer and token shards, computed once per (corpus, tokenizer) and shared by every run.


rule tokenizer:
    output:
        TOKENIZER,
    params:
        config={"corpus": config["corpus"], "tokenizer": config["tokenizer"]},
    log:
        f"{RESULTS}/logs/tokenizer/{EXP.tokenizer_id}.log",
    benchmark:
        f"{RESULTS}/benchmarks/tokenizer/{EXP.tokenizer_id}.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/tokenizer.py"


# train.bin and val.bin are written first; meta.json, the declared output, is written last
# and atomically, so its presence means the shards are complete.
rule tokenize:
    input:
        tokenizer=TOKENIZER,
    output:
        f"{DATA_DIR}/meta.json",
    params:
        config={"corpus": config["corpus"], "tokenizer": config["tokenizer"]},
        out_dir=DATA_DIR,
        data_id=EXP.data_id,
        tokenizer_id=EXP.tokenizer_id,
    log:
        f"{RESULTS}/logs/tokenize/{EXP.data_id}.log",
    benchmark:
        f"{RESULTS}/benchmarks/tokenize/{EXP.data_id}.tsv"
    conda:
        "../../envs/depthbench.yaml"
    script:
        "../../scripts/tokenize_corpus.py"
