"""The plan cache (depthbench.grid.plan_cache): a config planned before comes back equal to a fresh
expansion, validated in place as on a miss; anything the plan depends on (the config, the
`--config` values, the package's code, the files it names) plans afresh; a bad config is never
cached; a damaged entry is a miss."""

from __future__ import annotations

import copy
import datetime
import os
import json
import time

import pytest

from depthbench.grid import plan_cache
from depthbench.grid.plan_cache import plan_fresh, planned_grid
from depthbench.util.errors import ConfigError
from tests.conftest import tiny_config
from tests.plan_grids import two_architecture_grid, plan_summary


def counting(calls: list):
    """plan_fresh, recording each call: a miss."""

    def fresh(config, command_line):
        calls.append(1)
        return plan_fresh(config, command_line)

    return fresh


def test_the_caller_config_is_validated_in_place_on_a_hit_as_on_a_miss(wiki_jsonl, tmp_path):
    calls: list = []
    given = two_architecture_grid(wiki_jsonl)
    miss_config, hit_config = copy.deepcopy(given), copy.deepcopy(given)
    miss = planned_grid(miss_config, {}, tmp_path, fresh=counting(calls))
    hit = planned_grid(hit_config, {}, tmp_path, fresh=counting(calls))
    assert len(calls) == 1
    assert hit_config == miss_config != given  # defaults filled in, in place
    assert hit.experiment.config is hit_config  # what the Snakefile's rules read is the plan's
    assert plan_summary(hit) == plan_summary(miss)


def test_what_the_plan_depends_on_plans_afresh(wiki_jsonl, tmp_path, monkeypatch):
    calls: list = []

    def plan(config, command_line=None):
        return planned_grid(copy.deepcopy(config), command_line, tmp_path, fresh=counting(calls))

    config = two_architecture_grid(wiki_jsonl)
    plan(config)
    plan(config)
    assert len(calls) == 1
    # another config, other --config values
    plan({**config, "learning_rates": [3e-3]})
    assert len(calls) == 2
    plan(config, {"seeds": "[0, 1]"})
    assert len(calls) == 3
    # another version of the package's code
    monkeypatch.setattr(plan_cache, "package_digest", lambda: "another version of the code")
    plan(config)
    assert len(calls) == 4
    plan(config)
    assert len(calls) == 4


def test_a_named_file_that_changed_plans_afresh_and_one_gone_is_an_error(wiki_jsonl, tmp_path):
    """A `file` tokenizer's digest is in the tokenizer and data ids: a cached plan of the old file
    would name shards and runs of another tokenizer. A corpus file deleted since is the same
    ConfigError on a hit as on a miss."""
    from depthbench.data.prepare import build_tokenizer
    from depthbench.spec.schema import load_config

    calls: list = []
    tok = tmp_path / "tokenizer.json"
    build_tokenizer(load_config(tiny_config(wiki_jsonl)), str(tok))
    config = tiny_config(wiki_jsonl, tokenizer={"kind": "file", "path": str(tok)})
    first = planned_grid(copy.deepcopy(config), {}, tmp_path / "cache", fresh=counting(calls))
    text = json.loads(tok.read_text())
    text["added_tokens"] = text.get("added_tokens", []) + [
        {
            "id": 512,
            "content": "<|extra|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    ]
    tok.write_text(json.dumps(text))
    second = planned_grid(copy.deepcopy(config), {}, tmp_path / "cache", fresh=counting(calls))
    assert len(calls) == 2
    assert second.experiment.tokenizer_id != first.experiment.tokenizer_id
    assert set(second.experiment.runs).isdisjoint(first.experiment.runs)

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(wiki_jsonl.read_bytes())
    moved = tiny_config(corpus)
    planned_grid(copy.deepcopy(moved), {}, tmp_path / "cache")
    corpus.unlink()
    with pytest.raises(ConfigError) as err:
        planned_grid(copy.deepcopy(moved), {}, tmp_path / "cache")
    assert err.value.field == "corpus.path"


def test_a_bad_config_is_never_cached(wiki_jsonl, tmp_path):
    bad = tiny_config(wiki_jsonl, shapes=[{"n_layer": 2, "d_model": 50}])
    for _ in range(2):
        with pytest.raises(ConfigError) as err:
            planned_grid(copy.deepcopy(bad), {}, tmp_path)
        assert "shapes[0].d_model" in str(err.value)
    assert not list(tmp_path.glob("*"))


def test_a_damaged_entry_is_a_miss_and_is_rewritten(wiki_jsonl, tmp_path):
    calls: list = []
    config = two_architecture_grid(wiki_jsonl)
    expected = plan_summary(planned_grid(copy.deepcopy(config), {}, tmp_path))
    (entry,) = tmp_path.glob("*.json")
    whole = json.loads(entry.read_text())
    damaged = [
        entry.read_bytes()[:100],
        b"",
        json.dumps({"not": "a plan"}).encode(),
        json.dumps({**whole, "format": 0}).encode(),
        json.dumps({**whole, "runs": {"x": {"arch": "pre_ln"}}}).encode(),
    ]
    for damage in damaged:
        entry.write_bytes(damage)
        plan = planned_grid(copy.deepcopy(config), {}, tmp_path, fresh=counting(calls))
        assert plan_summary(plan) == expected
        assert json.loads(entry.read_text()) == whole
    assert len(calls) == len(damaged)


def test_only_the_newest_entries_are_kept(wiki_jsonl, tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cache, "KEEP", 2)
    config = two_architecture_grid(wiki_jsonl)
    for lr in (1e-3, 2e-3, 3e-3):
        planned_grid({**copy.deepcopy(config), "learning_rates": [lr]}, {}, tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_the_package_digest_changes_with_any_file_of_the_package(tmp_path):
    """An edited, added or renamed module is another digest (the architectures, their options
    and the schema's defaults all live in the package); compiled caches are not code."""
    import shutil

    copy_ = shutil.copytree(
        plan_cache.PACKAGE, tmp_path / "depthbench", ignore=shutil.ignore_patterns("__pycache__")
    )
    base = plan_cache.package_digest(copy_)
    assert base == plan_cache.package_digest(plan_cache.PACKAGE)
    (copy_ / "__pycache__").mkdir(exist_ok=True)
    (copy_ / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"compiled")
    assert plan_cache.package_digest(copy_) == base
    module = copy_ / "models" / "archs" / "hc.py"
    module.write_text(module.read_text() + "\n# an edit\n")
    edited = plan_cache.package_digest(copy_)
    (copy_ / "models" / "archs" / "new_arch.py").write_text("")
    added = plan_cache.package_digest(copy_)
    (copy_ / "models" / "archs" / "new_arch.py").rename(copy_ / "models" / "archs" / "renamed.py")
    assert len({base, edited, added, plan_cache.package_digest(copy_)}) == 4


def test_keys_that_json_would_merge_are_other_configs(wiki_jsonl, tmp_path):
    """YAML keeps key types (`1:` and `"1":`) and dates: the key tells them apart, so a plan
    cached for one is never served to the other; keys of mixed types reach the schema's error
    naming the field."""
    extra = lambda value: two_architecture_grid(wiki_jsonl, launcher={"slurm": {"extra": value}})  # noqa: E731
    assert plan_cache.plan_key(extra({1: "x"}), {}) != plan_cache.plan_key(extra({"1": "x"}), {})
    day = datetime.date(2024, 6, 1)
    assert plan_cache.plan_key(extra({"begin": day}), {}) != plan_cache.plan_key(
        extra({"begin": str(day)}), {}
    )
    planned_grid(copy.deepcopy(extra({"1": "x"})), {}, tmp_path)
    plan = planned_grid(copy.deepcopy(extra({1: "x"})), {}, tmp_path)
    assert plan.experiment.config["launcher"]["slurm"]["extra"] == {1: "x"}

    mixed = tiny_config(wiki_jsonl, learning_rates_by_arch={"pre_ln": [1e-3], 2: [1e-3]})
    with pytest.raises(ConfigError) as err:
        planned_grid(mixed, {}, tmp_path)
    assert "learning_rates_by_arch" in str(err.value)


def test_a_plan_json_cannot_hold_is_planned_on_every_call(wiki_jsonl, tmp_path):
    """A YAML date in a free-form field (an sbatch `begin:`) validates; JSON has no date, so the
    plan is not cached, and each call plans it, the date intact."""
    config = two_architecture_grid(
        wiki_jsonl, launcher={"slurm": {"extra": {"begin": datetime.date(2024, 6, 1)}}}
    )
    calls: list = []
    for _ in range(2):
        plan = planned_grid(copy.deepcopy(config), {}, tmp_path, fresh=counting(calls))
        assert plan.experiment.config["launcher"]["slurm"]["extra"]["begin"] == datetime.date(
            2024, 6, 1
        )
    assert len(calls) == 2 and not list(tmp_path.glob("*"))


def test_a_killed_writers_temporary_file_goes_once_an_hour_old(wiki_jsonl, tmp_path):
    old, recent = tmp_path / ".a.json.x1.tmp", tmp_path / ".b.json.x2.tmp"
    for stray in (old, recent):
        stray.write_text("{")
    hour_ago = time.time() - plan_cache.STRAY_AGE_S - 1
    os.utime(old, (hour_ago, hour_ago))
    planned_grid(copy.deepcopy(two_architecture_grid(wiki_jsonl)), {}, tmp_path)
    assert not old.exists() and recent.exists()
