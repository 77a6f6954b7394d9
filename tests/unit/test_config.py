"""Config validation names the field; the grid, the shapes and the run ids behave as documented."""

import copy

import pytest

from depthbench.grid.config import expand_grid
from depthbench.grid.expand import shape_table
from depthbench.spec.schema import load_config
from depthbench.util.errors import ConfigError
from depthbench.models.config import ModelConfig
from depthbench.models.registry import count_parameters
from depthbench.spec.shapes import solve_ratio, solve_width
from tests.conftest import tiny_config


def make(wiki_jsonl, **overrides):
    return expand_grid(load_config(tiny_config(wiki_jsonl, **overrides)))


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"architectures": ["pre_ln", "transformer_xl"]}, "architectures[1]"),
        ({"learning_rates": [1e-3, 0.0]}, "learning_rates[1]"),
        ({"learning_rates": [-1e-3]}, "learning_rates[0]"),
        ({"shapes": [{"n_layer": 2, "d_model": 50}]}, "shapes[0].d_model"),
        ({"shapes": [{"n_layer": 400}]}, "shapes[0]"),
        ({"shapes": [{"n_layer": 0}]}, "shapes[0].n_layer"),
        ({"shapes": [{"ratio": 8.0, "n_layer": 2}]}, "shapes[0]"),
        ({"model": {"n_head": 4, "n_kv_head": 3}}, "model.n_kv_head"),
        ({"train": {"global_batch_size": 10, "micro_batch_size": 4}}, "train.micro_batch_size"),
        ({"tokenizer": {"kind": "bpe"}}, "tokenizer.vocab_size"),
        ({"tokenizer": {"kind": "file", "path": "/nonexistent/tokenizer.json"}}, "tokenizer.path"),
        ({"launcher": {"backend": "kubernetes"}}, "launcher.backend"),
        ({"sweep": {"train.nonsense": [1, 2]}}, "sweep.train.nonsense"),
        ({"train": {"seq_lenn": 32}}, "train"),
        ({"learning_rates_by_arch": {"pre_ln": [1e-3, -2e-3]}}, "learning_rates_by_arch.pre_ln[1]"),
        ({"learning_rates_by_arch": {"pre_ln": []}}, "learning_rates_by_arch.pre_ln"),
        (
            {"learning_rates_by_arch": {"transformer_xl": [1e-3]}},
            "learning_rates_by_arch",
        ),  # no architecture at all
    ],
)
def test_invalid_configs_fail_naming_the_field(wiki_jsonl, overrides, field):
    with pytest.raises(ConfigError) as info:
        make(wiki_jsonl, **overrides)
    assert info.value.field == field, str(info.value)
    assert f"'{field}'" in str(info.value)


def test_missing_corpus_file_names_the_field(wiki_jsonl, tmp_path):
    config = tiny_config(wiki_jsonl)
    config["corpus"]["path"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="corpus.path") as info:
        expand_grid(load_config(config))
    assert "missing.jsonl" in str(info.value)


def test_unknown_architecture_lists_the_valid_ones(wiki_jsonl):
    with pytest.raises(ConfigError) as info:
        make(wiki_jsonl, architectures=["nope"])
    for name in ("pre_ln", "post_ln", "peri_ln", "lns", "deepnorm", "keel"):
        assert name in str(info.value)


def test_grid_is_the_product_of_its_axes(wiki_jsonl):
    exp = make(
        wiki_jsonl,
        architectures=["pre_ln", "lns"],
        shapes=[{"n_layer": 2}, {"n_layer": 4}],
        learning_rates=[1e-3, 3e-3, 1e-2],
        seeds=[0, 1],
        sweep={"train.weight_decay": [0.0, 0.1]},
    )
    assert len(exp.runs) == 2 * 2 * 3 * 2 * 2
    assert len(set(exp.runs)) == len(exp.runs)
    spec = next(iter(exp.runs.values()))
    assert spec.run_id.startswith(
        f"{spec.arch}_L{spec.shape.n_layer}-d{spec.shape.d_model}_lr{spec.lr:g}_s{spec.seed}_"
    )


def test_run_ids_are_stable_and_change_only_with_training_settings(wiki_jsonl):
    a = make(wiki_jsonl)
    b = make(wiki_jsonl)
    assert a.run_ids == b.run_ids
    # a new learning rate adds a run and keeps the old id
    c = make(wiki_jsonl, learning_rates=[3e-3, 1e-2])
    assert set(a.run_ids) < set(c.run_ids)
    # anything else that changes training changes the hash
    base = tiny_config(wiki_jsonl)
    changed = copy.deepcopy(base)
    changed["train"]["weight_decay"] = 0.0
    assert set(expand_grid(load_config(changed)).run_ids).isdisjoint(a.run_ids)
    # settings that do not change the weights do not
    same = copy.deepcopy(base)
    same["train"]["checkpoint_every"] = 1000
    same["launcher"] = {"backend": "local"}
    same["figures"] = {"dpi": 72}
    assert expand_grid(load_config(same)).run_ids == a.run_ids


def test_learning_rates_by_arch_replace_the_grid_for_that_architecture_only(wiki_jsonl):
    exp = make(
        wiki_jsonl,
        architectures=["pre_ln", "lns"],
        shapes=[{"n_layer": 2}, {"n_layer": 4}],
        learning_rates=[1e-3, 3e-3],
        learning_rates_by_arch={"lns": [2e-3, 4e-3, 8e-3]},
    )
    lrs = {(s.arch, s.shape.n_layer): set() for s in exp.runs.values()}
    for spec in exp.runs.values():
        lrs[(spec.arch, spec.shape.n_layer)].add(spec.lr)
    assert lrs == {
        ("pre_ln", 2): {1e-3, 3e-3},
        ("pre_ln", 4): {1e-3, 3e-3},
        ("lns", 2): {2e-3, 4e-3, 8e-3},
        ("lns", 4): {2e-3, 4e-3, 8e-3},
    }
    # the runs pre_ln shares with a plain grid keep their ids (an added architecture grid adds runs)
    plain = make(
        wiki_jsonl,
        architectures=["pre_ln", "lns"],
        shapes=[{"n_layer": 2}, {"n_layer": 4}],
        learning_rates=[1e-3, 3e-3],
    )
    assert {r for r in plain.run_ids if r.startswith("pre_ln")} == {
        r for r in exp.run_ids if r.startswith("pre_ln")
    }


def test_scientific_notation_without_sign_is_a_number(wiki_jsonl):
    config = tiny_config(wiki_jsonl)
    config["budget"]["params"] = "1.0e5"
    config["learning_rates"] = ["3e-3"]
    exp = expand_grid(load_config(config))
    assert next(iter(exp.runs.values())).lr == 3e-3


def test_shape_solver_picks_the_closest_width():
    base = ModelConfig(vocab_size=50280, n_head=16)
    for n_layer, d_model in ((16, 1216), (70, 640)):
        shape = solve_width(base, n_layer, 410e6, tolerance=None)  # the width pick, d_ff at 8/3
        assert shape.d_model == d_model
        assert shape.n_params == count_parameters(
            ModelConfig(vocab_size=50280, n_head=16, n_layer=n_layer, d_model=d_model)
        )
        for other in (d_model - 64, d_model + 64):
            n_other = count_parameters(
                ModelConfig(vocab_size=50280, n_head=16, n_layer=n_layer, d_model=other)
            )
            assert abs(n_other - 410e6) >= abs(shape.n_params - 410e6)
    assert round(solve_ratio(base, 76.0, 410e6).ratio, 1) == 76.0
    assert solve_ratio(base, 9.1, 410e6).n_layer == 70


def test_shape_table_has_one_row_per_arch_and_shape(wiki_jsonl):
    exp = make(
        wiki_jsonl,
        architectures=["pre_ln", "peri_ln"],
        shapes=[{"n_layer": 2}, {"n_layer": 3}],
        learning_rates=[1e-3, 2e-3],
    )
    rows = shape_table(exp)
    assert len(rows) == 4
    assert {"n_layer", "d_model", "ratio", "d_ff", "n_head", "params"} <= set(rows[0])
    # peri_ln has 2 extra norms per layer, charged to the budget
    pre = next(r for r in rows if r["arch"] == "pre_ln" and r["n_layer"] == 2)
    peri = next(r for r in rows if r["arch"] == "peri_ln" and r["n_layer"] == 2)
    if pre["d_model"] == peri["d_model"]:
        assert peri["params"] == pre["params"] + 2 * 2 * pre["d_model"]


def test_schema_architecture_enum_matches_the_registry():
    from depthbench.spec.schema import load_schema
    from depthbench.models.registry import ALIASES, ARCHITECTURES, canonical_arch

    canonical_arch("pre_ln")
    schema = load_schema()
    assert set(schema["properties"]["architectures"]["items"]["enum"]) == set(ARCHITECTURES) | set(
        ALIASES
    )


def test_settings_added_later_enter_the_hash_only_when_changed():
    from depthbench.spec.run import _hashed
    from depthbench.spec.training import TrainConfig

    values = TrainConfig().hashed_dict()
    values["a_future_setting"] = 1  # not a field of the dataclass: no default to match, hashed
    assert "a_future_setting" in _hashed(values, frozenset(), TrainConfig)
    assert "weight_decay" not in _hashed(TrainConfig().hashed_dict(), frozenset(), TrainConfig)
    assert _hashed({"weight_decay": 0.0}, frozenset(), TrainConfig) == {"weight_decay": 0.0}
    assert _hashed({"weight_decay": 0.1}, frozenset({"weight_decay"}), TrainConfig) == {
        "weight_decay": 0.1
    }


def test_identity_dict_round_trips_with_the_operational_settings(wiki_jsonl):
    from depthbench.spec.run import RunSpec

    config = load_config(tiny_config(wiki_jsonl))
    spec = next(iter(expand_grid(config).runs.values()))
    ident = spec.identity_dict()
    assert not {"threads", "checkpoint_every", "log_every"} & set(ident["train"])
    assert "dynamics_every" not in ident["train"]  # added after v1, at its default
    restored = RunSpec.from_dict(ident).with_operational(config["train"])
    assert restored.to_dict() == spec.to_dict()


def test_per_architecture_settings_outside_the_grid_are_ignored_and_listed(wiki_jsonl):
    """learning_rates_by_arch and arch_options may name any registered architecture: an entry no
    architecture of the grid reads changes no run and `ignored_settings` names it."""
    from depthbench.grid.config import ignored_settings
    from depthbench.grid.expand import grid_learning_rates

    plain = make(wiki_jsonl)
    config = load_config(
        tiny_config(
            wiki_jsonl,
            learning_rates_by_arch={"hc": [1e-3], "sandwich_ln": [2e-3]},
            model={"n_head": 2, "arch_options": {"n_blocks": 4, "n_streams": 2}},
        )
    )
    assert grid_learning_rates(config) == {"pre_ln": [3e-3]}
    assert expand_grid(config).run_ids == plain.run_ids
    ignored = ignored_settings(config)
    assert len(ignored) == 4, ignored
    for field in (
        "learning_rates_by_arch.hc",
        "learning_rates_by_arch.sandwich_ln",
        "model.arch_options.n_blocks",
        "model.arch_options.n_streams",
    ):
        assert any(line.startswith(field + ":") for line in ignored), (field, ignored)
    assert ignored_settings(load_config(tiny_config(wiki_jsonl))) == []


def test_an_unknown_architecture_in_learning_rates_by_arch_names_the_field(wiki_jsonl):
    from depthbench.grid.expand import grid_learning_rates

    config = load_config(tiny_config(wiki_jsonl))
    config["learning_rates_by_arch"] = {"transformer_xl": [1e-3]}  # past the schema's enum
    with pytest.raises(ConfigError) as info:
        grid_learning_rates(config)
    assert info.value.field == "learning_rates_by_arch.transformer_xl"
    assert "pre_ln" in str(info.value)


def test_validate_lists_the_ignored_settings(tmp_path, capsys):
    from depthbench.commands.cli import main

    config = tmp_path / "subset.yaml"
    text = (
        open("config/config.yaml")
        .read()
        .replace(
            "architectures: [pre_ln, lns, hc, mhc, attnres_full, attnres_block]",
            "architectures: [pre_ln, hc]",
        )
    )
    config.write_text(text)
    assert main(["validate", str(config)]) in (0, None)
    out = capsys.readouterr().out
    # 2 architectures x 3 depths: 18 runs, up to 2 extensions a cell, one replicate a cell
    assert "18 runs, at most 12 past cells' LR edges" in out and "and 6 replicates" in out
    for field in (
        "learning_rates_by_arch.lns",
        "learning_rates_by_arch.attnres_full",
        "model.arch_options.n_blocks",
    ):
        assert f"ignored (no architecture of the grid reads it): {field}:" in out, out
