"""The workflow tokenizes a corpus in pieces (corpus.pieces): one tokenize_piece job per piece and
one tokenize job that merges them into meta.json. A piece whose job was killed before its last
write (no piece.json) is the only piece the next run tokenizes again, followed by the merge and
without training the tokenizer again; the other pieces' files are left untouched."""

import json

import pytest

from depthbench.grid.config import expand_grid
from depthbench.spec.schema import load_config
from tests.conftest import tiny_config
from tests.workflow_runs import copy_workflow, job_counts, snakemake, split_corpus, write_config


@pytest.mark.slow
def test_workflow_tokenizes_in_pieces_and_reruns_only_a_lost_one(wiki_jsonl, tmp_path):
    (tmp_path / "wf").mkdir()
    root = copy_workflow(tmp_path / "wf")
    files = split_corpus(wiki_jsonl, tmp_path, 4)
    config = tiny_config(
        wiki_jsonl,
        corpus={"name": "t", "source": "local", "path": files, "val_fraction": 0.1, "pieces": 4},
    )
    write_config(root, config)
    exp = expand_grid(load_config(config))
    meta = f"results/data/{exp.data_id}/meta.json"
    first = snakemake(root, meta)
    assert job_counts(first.stdout + first.stderr).get("tokenize_piece") == 4
    pieces = root / "results" / "data" / exp.data_id / "pieces"
    # a job killed before its last write leaves no piece.json, and meta.json is never written
    # while a piece is missing
    (pieces / "00002" / "piece.json").unlink()
    (root / meta).unlink()
    before = {p: (pieces / f"{p:05d}" / "piece.json").stat().st_mtime_ns for p in (0, 1, 3)}
    plan = snakemake(root, meta, "-n")
    counts = job_counts(plan.stdout + plan.stderr)
    assert (
        counts.get("tokenize_piece") == 1
        and counts.get("tokenize") == 1
        and "tokenizer" not in counts
    )
    snakemake(root, meta)
    assert before == {p: (pieces / f"{p:05d}" / "piece.json").stat().st_mtime_ns for p in (0, 1, 3)}
    assert json.loads((root / meta).read_text())["pieces"] == 4
