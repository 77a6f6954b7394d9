"""A run's summary.json is read only as the run it names, with the grid's spec hash: one copied
from another run, written for another grid, edited, truncated or unreadable is an error naming the
file."""

from __future__ import annotations

import json
import re

import pytest

from depthbench.grid.config import expand_grid
from depthbench.spec.run import RunSpec
from depthbench.util.errors import DataError
from tests.run_outputs import fake_summary, grid_config


@pytest.fixture(scope="module")
def grid4(wiki_jsonl):
    return expand_grid(
        grid_config(wiki_jsonl, architectures=["pre_ln", "post_ln"], learning_rates=[3e-3, 50.0])
    )


def test_spec_hash_survives_the_train_rules_round_trip(grid4):
    """What scripts/train.py rebuilds from the rule's params (identity + operational settings)
    and writes into summary.json hashes to the grid's spec hash."""
    for spec in grid4.runs.values():
        rebuilt = RunSpec.from_dict(spec.identity_dict()).with_operational(
            {"threads": 2, "checkpoint_every": 7}
        )
        assert (
            RunSpec.from_dict(json.loads(json.dumps(rebuilt.to_dict()))).spec_hash()
            == spec.spec_hash()
        )
    assert len({s.spec_hash() for s in grid4.runs.values()}) == len(grid4.runs)


def test_summary_of_another_run_or_version_is_refused_by_name(grid4, tmp_path):
    from depthbench.train.runcheck import read_summary
    from depthbench.analysis.tables import run_rows

    a, b = list(grid4.runs.values())[:2]
    expected = {s.run_id: s.spec_hash() for s in grid4.runs.values()}
    pa, pb = fake_summary(tmp_path, a), fake_summary(tmp_path, b)
    assert len(run_rows([str(pa), str(pb)], 6.0, "tiny", expected=expected)) == 2
    pb.write_text(pa.read_text())  # copied over another run's
    with pytest.raises(DataError, match=re.escape(str(pb)) + ".*belongs to run"):
        run_rows([str(pa), str(pb)], 6.0, "tiny", expected=expected)
    fake_summary(tmp_path, b)
    with pytest.raises(DataError, match=re.escape(str(pb)) + ".*grid's spec"):
        read_summary(pb, {**expected, b.run_id: "0" * 16})  # the grid changed since it was written
    edited = json.loads(pb.read_text())
    edited["spec"]["train"]["weight_decay"] = 0.5
    pb.write_text(json.dumps(edited))
    with pytest.raises(DataError, match="edited"):
        read_summary(pb, expected)


@pytest.mark.parametrize("content", ['{"run_id": "x", "status": "o', "", "\xff\xfe", "[1, 2]"])
def test_truncated_or_unreadable_summary_is_an_error_naming_the_file(grid4, tmp_path, content):
    from depthbench.analysis.tables import run_rows

    path = fake_summary(tmp_path, next(iter(grid4.runs.values())))
    path.write_bytes(content.encode("latin-1"))
    with pytest.raises(DataError, match=re.escape(str(path))):
        run_rows([str(path)], 6.0, "tiny")
