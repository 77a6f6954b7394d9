"""What a fresh interpreter imports, as each Snakemake job and `depthbench` command starts one:
training a few steps of every registered architecture and counting parameters leave
torch._dynamo unimported (1.2-2.5 s of every short job), and a plan read back from the plan
cache imports no torch at all and equals a fresh expansion of the same config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from depthbench.grid.plan_cache import plan_fresh
from tests.conftest import REPO
from tests.plan_grids import two_architecture_grid, plan_summary


@pytest.mark.slow
def test_training_every_architecture_imports_no_dynamo(tiny_data, tmp_path):
    """In a fresh interpreter, as a Snakemake job runs it: a few steps of every registered
    architecture (no checkpoint inside them) leave torch._dynamo unimported."""
    import depthbench.models.archs  # noqa: F401  (registers every architecture)
    from depthbench.grid.config import expand_grid
    from depthbench.models.registry import ARCHITECTURES
    from depthbench.spec.schema import load_config

    config, _, shards = tiny_data
    specs = {}
    for arch in ARCHITECTURES:
        (spec,) = expand_grid(load_config({**config, "architectures": [arch]})).runs.values()
        spec_dict = spec.to_dict()
        spec_dict["train"].update(total_steps=3, checkpoint_every=100, eval_every=100)
        specs[arch] = spec_dict
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    code = (
        "import json, sys\n"
        "from depthbench.spec.run import RunSpec\n"
        "from depthbench.train.loop import train\n"
        "from depthbench.train.recipe import RunPaths\n"
        "specs = json.load(open(sys.argv[1]))\n"
        "out = {}\n"
        "for arch, spec in specs.items():\n"
        "    root = sys.argv[3] + '/' + arch\n"
        "    summary = train(RunSpec.from_dict(spec), sys.argv[2], RunPaths(root + '/run', "
        "root + '/work'), progress=False)\n"
        "    out[arch] = [summary['status'], 'torch._dynamo' in sys.modules]\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "specs.json"), str(shards), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == set(ARCHITECTURES)
    assert all(status == "ok" for status, _ in result.values()), result
    # in order: the first architecture whose training pulled torch._dynamo in is named
    with_dynamo = [arch for arch, (_, imported) in result.items() if imported]
    assert not with_dynamo, f"torch._dynamo imported while training {with_dynamo[0]}"


@pytest.mark.slow
def test_a_cached_plan_equals_a_fresh_one_and_imports_no_torch(wiki_jsonl, tmp_path):
    """Two fresh interpreters plan the same config file: the first expands it (and imports torch
    for the registry and the parameter counts), the second reads the cache, imports no torch, and
    gets the same validated config, run specs, ids and figures as an expansion in this process,
    down to their reprs (what Snakemake compares a job's params by)."""
    cfg, cache = tmp_path / "config.yaml", tmp_path / "cache"
    cfg.write_text(yaml.safe_dump(two_architecture_grid(wiki_jsonl, seeds_at_best_lr=2)))
    code = (
        "import json, sys, yaml\n"
        "from depthbench.grid.plan_cache import planned_grid\n"
        f"plan = planned_grid(yaml.safe_load(open({str(cfg)!r})), {{}}, {str(cache)!r})\n"
        "exp = plan.experiment\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'repr': repr(plan),\n"
        "    'config': exp.config,\n"
        "    'runs': {r: s.to_dict() for r, s in exp.candidate_runs.items()},\n"
        "    'ids': [exp.vocab_size, exp.tokenizer_id, exp.data_id], 'figures': plan.figures}))\n"
    )

    def plan_in_new_interpreter() -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
        )
        return json.loads(proc.stdout)

    first, second = plan_in_new_interpreter(), plan_in_new_interpreter()
    assert first.pop("torch") and not second.pop("torch")
    fresh = plan_fresh(yaml.safe_load(cfg.read_text()), {})
    expected = json.loads(json.dumps({"repr": repr(fresh), **plan_summary(fresh)}))
    assert first == second == expected
    assert len(expected["runs"]) == 8  # 2 archs x 2 LRs x (the sweep's seed and a replicate)


@pytest.mark.slow
def test_counting_parameters_does_not_start_torch_dynamo():
    """Snakemake, `depthbench status` and plan count parameters to solve the grid's shapes, each
    in a new interpreter: counting must not import torch._dynamo (2.5 s), as torch.device('meta')
    would (its arange and eye import it)."""
    code = (
        "import sys\n"
        "from depthbench.models.config import ModelConfig\n"
        "from depthbench.models.registry import PACKAGE_ARCHITECTURES, count_parameters\n"
        "for arch in PACKAGE_ARCHITECTURES:\n"
        "    count_parameters(ModelConfig(arch=arch, vocab_size=97, d_model=32, n_layer=2,"
        " n_head=2, max_seq_len=16))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
