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


PIECES = config["corpus"].get("pieces", 1)

if PIECES == 1:

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

else:
    # corpus.pieces > 1: one job counts the documents per file, PIECES jobs tokenize their
    # ranges (each piece.json written last and atomically: a killed job reruns alone), and
    # `tokenize` merges the pieces' counts into meta.json, written last and atomically.
    rule tokenize_index:
        output:
            f"{DATA_DIR}/index.json",
        params:
            config={"corpus": config["corpus"], "tokenizer": config["tokenizer"]},
        log:
            f"{RESULTS}/logs/tokenize/{EXP.data_id}.index.log",
        conda:
            "../../envs/depthbench.yaml"
        script:
            "../../scripts/tokenize_corpus.py"

    rule tokenize_piece:
        input:
            tokenizer=TOKENIZER,
            index=f"{DATA_DIR}/index.json",
        output:
            f"{DATA_DIR}/pieces/{{piece}}/piece.json",
        wildcard_constraints:
            piece="[0-9]{5}",
        params:
            config={"corpus": config["corpus"], "tokenizer": config["tokenizer"]},
        log:
            f"{RESULTS}/logs/tokenize/{EXP.data_id}.{{piece}}.log",
        benchmark:
            f"{RESULTS}/benchmarks/tokenize/{EXP.data_id}.{{piece}}.tsv"
        conda:
            "../../envs/depthbench.yaml"
        script:
            "../../scripts/tokenize_corpus.py"

    rule tokenize:
        input:
            tokenizer=TOKENIZER,
            pieces=[f"{DATA_DIR}/pieces/{p:05d}/piece.json" for p in range(PIECES)],
        output:
            f"{DATA_DIR}/meta.json",
        params:
            config={"corpus": config["corpus"], "tokenizer": config["tokenizer"]},
            out_dir=DATA_DIR,
            data_id=EXP.data_id,
            tokenizer_id=EXP.tokenizer_id,
        log:
            f"{RESULTS}/logs/tokenize/{EXP.data_id}.log",
        conda:
            "../../envs/depthbench.yaml"
        script:
            "../../scripts/tokenize_corpus.py"
