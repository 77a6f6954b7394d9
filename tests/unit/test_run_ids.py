"""Run ids hash only what changes the run: each architecture's id covers the options it declares
(its `Options` dataclass, defaults filled in), never another architecture's."""

from __future__ import annotations

import dataclasses

import pytest

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config, load_schema
from depthbench.models.registry import ARCHITECTURES, declared_options, registered_architectures


def _grid(arch_options: dict | None = None) -> dict[str, str]:
    """{architecture: its run id} for every registered architecture at one small explicit shape."""
    overrides = {
        "architectures": registered_architectures(),
        "shapes": [{"n_layer": 4, "d_model": 64}],
        "learning_rates": [1e-3],
        "learning_rates_by_arch": {},
    }
    config = load_config("config/config.yaml", overrides)
    config["learning_rates_by_arch"] = {}
    config["model"]["arch_options"] = dict(arch_options or {})
    runs = expand_grid(config).runs
    assert len(runs) == len(registered_architectures())
    return {spec.arch: run_id for run_id, spec in runs.items()}


def _other_value(name: str, default):
    """A valid value of option `name` other than its default, from the config schema."""
    spec = load_schema()["properties"]["model"]["properties"]["arch_options"]["properties"][name]
    if "enum" in spec:
        return next(v for v in spec["enum"] if v != default)
    if spec.get("type") == "boolean":
        return not default
    if spec.get("type") == "integer":
        return default + 1
    raise AssertionError(f"no other value known for arch option {name!r}: {spec}")


def _declared() -> dict[str, dict]:
    return {
        arch: {f.name: f.default for f in dataclasses.fields(ARCHITECTURES[arch].Options)}
        for arch in registered_architectures()
    }


def test_every_declared_option_is_a_schema_field():
    schema = load_schema()["properties"]["model"]["properties"]["arch_options"]["properties"]
    for arch, options in _declared().items():
        assert set(options) <= set(schema), (arch, set(options) - set(schema))


def test_changing_an_architectures_option_changes_only_the_ids_of_architectures_that_declare_it():
    """Every option of every registered architecture in turn: the ids that change are exactly
    those of the architectures whose Options declare it (n_streams is hc's and mhc's)."""
    declared = _declared()
    base = _grid()
    assert any(declared.values()), "no architecture declares an option"
    for arch, options in declared.items():
        for name, default in options.items():
            changed = _grid({name: _other_value(name, default)})
            moved = {a for a in base if base[a] != changed[a]}
            readers = {a for a, opts in declared.items() if name in opts}
            assert arch in moved, (arch, name)
            assert moved == readers, (
                f"changing {name} ({arch}) renamed {sorted(moved - readers)} too"
            )


def test_a_default_written_out_is_the_same_run():
    declared = _declared()
    every_default = {
        name: default for options in declared.values() for name, default in options.items()
    }
    assert _grid(every_default) == _grid({})


def test_run_specs_hold_only_their_architectures_options():
    config = load_config("config/config.yaml")
    for spec in expand_grid(config).runs.values():
        assert spec.model.arch_options == declared_options(spec.arch, {"n_blocks": 4})
        if spec.arch == "pre_ln":
            assert spec.model.arch_options == {}
        if spec.arch == "attnres_block":
            assert spec.model.arch_options["n_blocks"] == 4


def test_n_blocks_renames_only_attnres_block_runs_of_the_default(tmp_path):
    config = load_config("config/config.yaml")
    before = [spec.arch + ":" + run_id for run_id, spec in expand_grid(config).runs.items()]
    config["model"]["arch_options"]["n_blocks"] = 2
    after = [spec.arch + ":" + run_id for run_id, spec in expand_grid(config).runs.items()]
    assert len(before) == len(after) == 54
    differ = {b.split(":")[0] for b, a in zip(before, after) if b != a}
    assert differ == {"attnres_block"}
    assert sum(b != a for b, a in zip(before, after)) == 9


@pytest.mark.parametrize("bad", [{"n_blocks": 0}, {"n_streams": 0}])
def test_a_bad_declared_option_names_the_field(bad):
    from depthbench.util.errors import ConfigError

    arch = "attnres_block" if "n_blocks" in bad else "hc"
    with pytest.raises(ConfigError, match=f"model.arch_options.{next(iter(bad))}"):
        declared_options(arch, bad)
