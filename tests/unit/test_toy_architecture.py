"""A twelfth architecture, registered here and nowhere else, goes through config validation,
grid expansion, training, the probe stage, NLL and cost: nothing outside this file knows its name.
It is registered for the test only (`registered`): afterwards the registry is exactly as before.

The toy: Pre-LN with a learned scalar gate per sublayer (x <- x + g F(N(x)), g initialised at 1),
plus one extra matmul term charged to the cost through its own `extra_flops_per_token`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pandas as pd
import pytest
import torch
from torch import nn

from depthbench.grid.config import expand_grid
from depthbench.models.archs.pre_ln import PreLN, PreLNBlock
from depthbench.models.base import ArchOptions
from depthbench.models.cost import analytic_cost
from depthbench.models.registry import ALIASES, ARCHITECTURES, registered
from depthbench.spec.schema import load_config


@dataclass(frozen=True)
class GatedOptions(ArchOptions):
    gate_init: float = 1.0


class GatedBlock(PreLNBlock):
    def __init__(self, cfg, layer_index):
        super().__init__(cfg, layer_index)
        self.gates = nn.Parameter(torch.ones(2))

    def forward(self, x, rope, internals=None):
        x = x + self.gates[0] * self.attn(self.attn_norm(x), rope)
        return x + self.gates[1] * self.ffn(self.ffn_norm(x))


class ToyGated(PreLN):
    """Registered by the test only (`registered`), under the name "toy_gated"."""

    block_class = GatedBlock
    Options = GatedOptions

    def init_architecture(self):
        for block in self.blocks:
            nn.init.constant_(block.gates, self.options.gate_init)

    def extra_flops_per_token(self, seq_len: int) -> float:
        return 2.0 * self.cfg.n_layer  # the two gate multiplies per layer, as a stand-in term


@pytest.fixture
def toy():
    """The toy registered for one test; the registry (names, classes, order, aliases) is checked
    to be exactly as before once it is unregistered."""
    before = (list(ARCHITECTURES.items()), list(ALIASES.items()))
    with registered(ToyGated, "toy_gated"):
        assert list(ARCHITECTURES)[-1] == "toy_gated"
        yield "toy_gated"
    assert (list(ARCHITECTURES.items()), list(ALIASES.items())) == before


def test_a_toy_architecture_trains_probes_scores_and_costs(toy, tiny_data, tmp_path):
    from depthbench.evals.run import build_sets, run_nll
    from depthbench.probes.run import run_probes
    from depthbench.train.recipe import RunPaths
    from depthbench.train.loop import train

    config, exp, data_dir = tiny_data
    # The pre_ln grid's config naming the toy instead, validated and expanded like any other.
    overrides = {"architectures": [toy], "model": {"arch_options": {"gate_init": 0.5}}}
    toy_config = load_config(config, {**overrides, "train": {"max_steps": 6}})
    toy_exp = expand_grid(toy_config)
    assert toy_exp.data_id == exp.data_id  # the shards built for the pre_ln grid serve it
    (spec,) = toy_exp.runs.values()
    assert spec.arch == toy and spec.run_id.startswith(f"{toy}_")
    assert spec.model.arch_options == {"gate_init": 0.5} and spec.train.total_steps == 6
    paths = RunPaths(
        tmp_path / "runs" / spec.run_id, tmp_path / "work"
    )  # the stages check the folder's run id
    summary = train(spec, data_dir, paths, progress=False)
    assert summary["status"] == "ok"
    assert summary["n_params"] == analytic_cost(spec.model, spec.train.seq_len)["params_total"]

    probes_out = tmp_path / "probes.parquet"
    run_probes(
        spec.to_dict(),
        str(data_dir),
        str(paths.run_dir),
        str(probes_out),
        {"n_sequences": 3, "seq_len": 16},
    )
    rows = pd.read_parquet(probes_out)
    assert {
        "causal_score",
        "permutation_score",
        "usefulness_ratio",
        "angular_distance_last",
    } <= set(rows["probe"])
    assert (rows["run_id"] == spec.run_id).all()

    sets = tmp_path / "sets.parquet"
    build_sets(
        {"sets": ["gsm8k"], "max_docs_per_set": 3},
        str(data_dir.parent / "tokenizer.json"),
        None,
        str(sets),
    )
    nll_out = tmp_path / "nll.parquet"
    run_nll(
        spec.to_dict(),
        str(paths.run_dir),
        str(sets),
        str(nll_out),
        {"sets": ["gsm8k"], "max_docs_per_set": 3},
    )
    nll = pd.read_parquet(nll_out)
    assert nll["bits_per_byte"].notna().all()

    cost = analytic_cost(spec.model, spec.train.seq_len)
    baseline = analytic_cost(
        replace(spec.model, arch="pre_ln", arch_options={}), spec.train.seq_len
    )
    assert cost["params_extra_vs_pre_ln"] == 2 * spec.model.n_layer  # the gates
    assert cost["forward_flops_per_token"] - baseline["forward_flops_per_token"] == pytest.approx(
        2.0 * spec.model.n_layer
    )
    assert json.loads(paths.summary.read_text())["spec"]["arch"] == toy
