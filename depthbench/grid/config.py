"""The config grid's entry points: `expand_grid` checks what a schema-valid config names
(depthbench.grid.checks) and expands its grid into runs (depthbench.grid.expand), with the
tokenizer, data and run ids of depthbench.grid.ids; `ignored_settings` lists the
per-architecture settings no run of the grid reads."""

from __future__ import annotations

from depthbench.grid.checks import check_named
from depthbench.grid.expand import Experiment, grid_runs, replicate_runs
from depthbench.grid.extend import extension_runs
from depthbench.grid.ids import data_id, tokenizer_id
from depthbench.models.registry import canonical_arch
from depthbench.models.registry import declared_options, registered_architectures


def expand_grid(config: dict) -> Experiment:
    """Validate the semantics of a schema-valid config and return every run of its grid."""
    vocab_size = check_named(config)
    exp = Experiment(
        config=config,
        vocab_size=vocab_size,
        tokenizer_id=tokenizer_id(config),
        data_id=data_id(config),
    )
    exp.runs = grid_runs(exp)
    exp.extensions = extension_runs(exp.runs, config.get("lr_sweep", {}).get("max_extensions", 0))
    exp.replicates = replicate_runs(exp)
    return exp


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
                    f"{field_name}.{key}: only {users} read it, "
                    f"none of them in architectures {list(listed)}"
                )
    return out
