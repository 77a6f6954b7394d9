"""Config values that cannot run get an error naming the field, or the file and line, before any
training step: numbers that are not finite or out of range, init rules, head counts, YAML syntax,
a tokenizer file that is not JSON."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from depthbench.grid.config import expand_grid
from depthbench.models.config import ModelConfig
from depthbench.spec.schema import load_config
from depthbench.util.errors import ConfigError
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    "edit, field",
    [
        ("learning_rates: [.nan]", "learning_rates[0]"),
        ("learning_rates: [.inf]", "learning_rates[0]"),
        ("learning_rates: [-.inf]", "learning_rates[0]"),
        ("budget: {params: .nan, d_model_multiple: 16, d_ff_multiple: 16}", "budget.params"),
        ("train: {weight_decay: .inf}", "train.weight_decay"),
        ("sweep: {train.weight_decay: [0.1, .nan]}", "sweep.train.weight_decay[1]"),
        ("sweep: {train.weight_decay: [0.1, -1]}", "sweep.train.weight_decay[1]"),
        ("sweep: {train.beta2: [0.95, 1.5]}", "sweep.train.beta2[1]"),
        ("sweep: {model.n_head: [2, 0]}", "sweep.model.n_head[1]"),
    ],
)
def test_numbers_that_are_not_finite_or_in_range_name_the_field(wiki_jsonl, tmp_path, edit, field):
    config = tiny_config(wiki_jsonl)
    config.update(yaml.safe_load(edit))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert exc.value.field == field


@pytest.mark.parametrize(
    "rule", ["10**10**10", "sqrt(-1)", "1/(d_model-d_model)", "-0.02", "(" * 400 + "1" + ")" * 400]
)
def test_init_rules_are_evaluated_at_validation_naming_model_init_std(wiki_jsonl, rule):
    config = tiny_config(wiki_jsonl)
    config["model"] = {"n_head": 2, "init_std": rule}
    with pytest.raises(ConfigError) as exc:
        expand_grid(load_config(config))
    assert exc.value.field == "model.init_std"


def test_head_count_hint_lists_exactly_the_counts_that_pass_every_check():
    with pytest.raises(ConfigError) as exc:
        ModelConfig(d_model=48, n_head=5, vocab_size=50, n_layer=1)
    hinted = json.loads(
        re.search(r"valid head counts for this width: (\[.*\])", str(exc.value)).group(1)
    )

    def builds(h):
        try:
            ModelConfig(d_model=48, n_head=h, vocab_size=50, n_layer=1)
            return True
        except ConfigError:
            return False

    assert hinted == [h for h in range(1, 65) if builds(h)] == [1, 2, 3, 4, 6, 8, 12, 24]


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ncorpus:\n  name: [unclosed\nshapes: []\n")
    with pytest.raises(
        ConfigError, match=re.escape(str(path)) + r": line \d+, column \d+: YAML syntax error"
    ):
        load_config(path)
    path.write_text("- a list\n- not a mapping\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


def test_tokenizer_file_that_is_not_json_names_the_field_and_path(wiki_jsonl, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("this is not JSON")
    config = tiny_config(wiki_jsonl, tokenizer={"kind": "file", "path": str(path)})
    with pytest.raises(ConfigError) as exc:
        expand_grid(load_config(config))
    assert exc.value.field == "tokenizer.path" and str(path) in str(exc.value)
