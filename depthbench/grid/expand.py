"""Expansion of a checked config into runs: the grid is architectures x shapes x learning_rates x
seeds x every list under `sweep`, where `learning_rates_by_arch` may give an architecture its own
learning rates (`grid_learning_rates`); shapes are solved for the parameter budget
(`resolve_shapes`), and `shape_table` lists them."""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from depthbench.util.errors import ConfigError
from depthbench.grid.ids import run_id_of
from depthbench.models.config import ModelConfig
from depthbench.models.registry import canonical_arch
from depthbench.models.registry import declared_options, registered_architectures
from depthbench.spec.shape_count import Shape, shape_of
from depthbench.spec.shapes import solve_ratio, solve_width
from depthbench.spec.run import RunSpec
from depthbench.spec.training import TrainConfig


@dataclass
class Experiment:
    config: dict
    vocab_size: int
    tokenizer_id: str
    data_id: str
    runs: dict[str, RunSpec] = field(default_factory=dict)
    # `seeds_at_best_lr`: {sweep run id at the first seed: {replicate run id: spec}} for every
    # cell x learning rate, extensions included; which of them exist is decided once the LR
    # sweep (`runs`, then its extensions) is done
    replicates: dict[str, dict[str, RunSpec]] = field(default_factory=dict)
    # `lr_sweep.max_extensions`: every run the sweep may add past a cell's edge
    # (depthbench.grid.extend); which of them train is decided round by round
    extensions: dict[str, RunSpec] = field(default_factory=dict)

    @property
    def run_ids(self) -> list[str]:
        return list(self.runs)

    @property
    def candidate_runs(self) -> dict[str, RunSpec]:
        """Every run the workflow may train: the sweep, its extensions and every replicate
        candidate."""
        out = {**self.runs, **self.extensions}
        for replicas in self.replicates.values():
            out.update(replicas)
        return out


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


def grid_runs(exp: Experiment) -> dict[str, RunSpec]:
    """Every run of the grid of `exp.config` (checked: depthbench.grid.checks), by run id: each
    sweep point x architecture x shape x learning rate x seed, its total steps from the
    token budget (`train.tokens_per_param`, capped by `train.max_steps`)."""
    config, vocab_size, d_id, tok_id = exp.config, exp.vocab_size, exp.data_id, exp.tokenizer_id
    runs: dict[str, RunSpec] = {}
    train_section = config.get("train", {})
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
                        # one rank here; the trainer checks again with the run's ranks
                        train.check()
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
                        runs[spec.run_id] = spec
    return runs


def replicate_seeds(config: dict) -> list[int]:
    """The seeds that `seeds_at_best_lr: n` adds at each cell's best learning rate: the next
    integers after the largest of `seeds`, until the best LR has n seeds; none when `seeds`
    already has n."""
    seeds = [int(s) for s in config.get("seeds", [0])]
    wanted = int(config.get("seeds_at_best_lr") or 0)
    return list(range(max(seeds) + 1, max(seeds) + 1 + max(0, wanted - len(seeds))))


def replicate_runs(exp: Experiment) -> dict[str, dict[str, RunSpec]]:
    """{run id of each sweep run at the first seed: {run id: spec} of its replicates}, one per
    seed of `replicate_seeds`: the same run but for the seed (its data order and initialisation),
    so a replicate's run id is the one the plain product `seeds:` would give it."""
    extra = replicate_seeds(exp.config)
    if not extra:
        return {}
    first = int(exp.config.get("seeds", [0])[0])
    out: dict[str, dict[str, RunSpec]] = {}
    for run_id, spec in {**exp.runs, **exp.extensions}.items():
        if spec.seed != first:
            continue
        replicas = {}
        for seed in extra:
            replica = replace(spec, run_id="", seed=seed, train=replace(spec.train, seed=seed))
            replica.run_id = run_id_of(replica)
            replicas[replica.run_id] = replica
        out[run_id] = replicas
    return out


def grid_learning_rates(config: dict) -> dict[str, list[float]]:
    """The learning rates the grid tries for each name in `architectures`: its
    `learning_rates_by_arch` entry when it has one, else `learning_rates`.

    Why per architecture: the best LR at one budget moves by a factor of 4 or more between
    architectures (the AttnRes variants want 1.25e-2 or more where Pre-LN at L = 2 wants 2e-3 or
    less, docs/design/budget.md), so one grid leaves most cells' best at its edge. A key may be any
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
                "names no architecture; valid keys: the registered architectures "
                f"{registered_architectures()} or their aliases",
            ) from None
    default = [float(v) for v in config["learning_rates"]]
    return {
        name: [float(v) for v in by_arch.get(name, by_arch.get(canonical, default))]
        for name, canonical in listed.items()
    }


def _first_valid_width(n_head: int) -> int:
    # A placeholder width for the base config (replaced by each shape); must satisfy the checks.
    return 2 * n_head


def params_vs_budget(n_params: int, budget_params: float | None) -> float:
    """Relative deviation of a built model from the budget (-0.0031 = 0.31% under); NaN without
    one."""
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
