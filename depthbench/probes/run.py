"""The probe stage of one run: load its final weights, draw the fixed validation sample, compute
every probe that applies to its architecture, write tidy rows to one Parquet file.

Tidy form: one row per (probe, stage, i, j) with `value`; `stage` is "trained" or "init"
(the same architecture and seed, freshly initialised) or "init_no_prefix_avg"; i and j are
layer (or sublayer / source) indices, -1 where unused; `step` is the number of updates of the
weights probed (0 at init, the run's last step for "trained"). Summary probes (shares above
threshold, fraction of useful layers, residual-product rank, dead zone) are rows too. With
probes.at_steps the run's snapshots add rows of stage "snapshot" at their steps
(depthbench.probes.steps).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
import torch

from depthbench.schema import schema_defaults
from depthbench.data.shards import read_meta, split_files
from depthbench.io import atomic_write
from depthbench.models import build_model
from depthbench.probes import core, interventions, lens, removal
from depthbench.probes.steps import snapshot_rows
from depthbench.runcheck import check_run
from depthbench.spec import RunSpec
from depthbench.train.checkpoint import load_final_model


def probe_settings(settings: dict) -> dict:
    """The schema's probe defaults, then the operational thread count (1 unless the dispatcher
    passes the cores of the job), then `settings`."""
    return {**schema_defaults("probes"), "threads": 1, **settings}


def validation_tokens(data_dir: str) -> np.ndarray:
    """The validation split's token stream, in shard order."""
    meta = read_meta(data_dir)
    return np.concatenate([np.memmap(f, dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r") for f in split_files(data_dir, meta, "val")])


def probe_sample(data_dir: str, n_sequences: int, seq_len: int, seed: int) -> torch.Tensor:
    """The fixed, seeded sample: n windows of seq_len + 1 tokens from the validation split."""
    tokens = validation_tokens(data_dir)
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"{data_dir}: validation split shorter than one probe window of {seq_len + 1} tokens")
    rng = np.random.default_rng(seed)
    picks = rng.choice(n_windows, size=min(n_sequences, n_windows), replace=False)
    return torch.from_numpy(np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64) for i in sorted(picks)]))


def _rows(probe: str, stage: str, matrix: torch.Tensor) -> list[dict]:
    rows = []
    if matrix.dim() == 1:
        for i, v in enumerate(matrix.tolist()):
            if not math.isnan(v):
                rows.append({"probe": probe, "stage": stage, "i": i, "j": -1, "value": v})
        return rows
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            v = float(matrix[i, j])
            if not math.isnan(v):
                rows.append({"probe": probe, "stage": stage, "i": i, "j": j, "value": v})
    return rows


def _scalar(probe: str, stage: str, value: float) -> dict:
    return {"probe": probe, "stage": stage, "i": -1, "j": -1, "value": float(value)}


def _per_layer_rows(stage: str, hidden: list[torch.Tensor]) -> list[dict]:
    """Token similarity (with and without position 0) and effective rank at every layer: the
    per-layer curves drawn at init, at init without the prefix-average part, and trained."""
    return (_rows("token_similarity", stage, torch.tensor(core.token_similarity_by_layer(hidden)))
            + _rows("token_similarity_no_pos0", stage, torch.tensor(core.token_similarity_by_layer(hidden, skip_first=True)))
            + _rows("effective_rank", stage, torch.tensor(core.effective_rank_by_layer(hidden))))


def _matrix_probe(rows: list[dict], name: str, stage: str, matrix: torch.Tensor, threshold: float) -> None:
    rows += _rows(f"{name}_score", stage, matrix)
    rows.append(_scalar(f"{name}_share", stage, core.share_above(matrix, threshold)))


@torch.no_grad()
def probe_model(adapter, idx: torch.Tensor, stage: str, settings: dict, full: bool) -> list[dict]:
    """Every probe that applies to the model (`adapter.probes`) on the sample `idx` (N, T + 1),
    as tidy rows. `full=False` (an initialisation) computes only the cheap per-layer probes."""
    rows: list[dict] = []
    applies = adapter.probes
    inputs = idx[:, :-1]
    hidden = core.residual_stream(adapter, inputs)
    rows += _per_layer_rows(stage, hidden)
    if stage == "init" and "prefix_average" in applies:
        with interventions.without_prefix_average(adapter):
            rows += _per_layer_rows("init_no_prefix_avg", core.residual_stream(adapter, inputs))
    records = adapter.records(inputs) if applies & {"residual_product_rank", "depth_weight"} else {}
    if "residual_product_rank" in applies:  # at init too: the trained rank means little without it
        rows.append(_scalar("residual_product_rank", stage, core.residual_product_rank(records["stream_mixing"])))
    if not full:
        return rows
    rows += _rows("angular_distance_last", stage, core.angular_distance(hidden, last_token_only=True))
    rows += _rows("angular_distance_all", stage, core.angular_distance(hidden, last_token_only=False))
    # ShortGPT's block influence BI_l = 1 - mean cos(h_(l-1), h_l), one of the removal rankings
    rows += _rows("block_influence", stage, torch.tensor([float("nan")] + removal.block_influence(hidden).tolist()))
    if "logit_lens" in applies:
        for name, per_layer in lens.logit_lens(adapter, idx).items():
            rows += _rows(name, stage, per_layer)
    workers = int(settings["threads"])  # the passes of one probe are shared among that many workers
    _matrix_probe(rows, "causal", stage, interventions.causal_scores(adapter, inputs, workers), settings["causal_threshold"])
    _matrix_probe(rows, "permutation", stage, interventions.permutation_scores(adapter, idx, workers), settings["permutation_threshold"])
    if "usefulness_ratio" in applies:
        r = interventions.usefulness_ratios(adapter, idx, workers)
        rows += _rows("usefulness_ratio", stage, r)
        rows.append(_scalar("useful_fraction", stage, float((r[1:] > settings["usefulness_threshold"]).float().mean())))
    if "depth_weight" in applies:
        for s, w in enumerate(records["depth_weights"], start=1):
            rows += [{"probe": "depth_weight", "stage": stage, "i": s, "j": i, "value": v} for i, v in enumerate(w.tolist())]
    if "dead_zone_layers" in applies:
        length, weights = adapter.dead_zone(records["depth_weights"], settings["dead_zone_threshold"])
        rows += _rows("partial_sum_weight", stage, torch.tensor([float("nan")] + weights))
        rows.append(_scalar("dead_zone_layers", stage, length))
    return rows


def run_probes(spec_dict: dict, data_dir: str, run_dir: str, out_path: str, settings: dict) -> dict:
    """Probe one run (trained weights, and its initialisation) and write its Parquet file."""
    settings = probe_settings(settings)
    torch.set_num_threads(int(settings["threads"]))
    spec = RunSpec.from_dict(spec_dict)
    summary = check_run(run_dir, spec)  # identity and weights, before any work
    seq_len = settings["seq_len"] or spec.train.seq_len
    idx = probe_sample(data_dir, settings["n_sequences"], min(seq_len, spec.model.max_seq_len), settings["seed"])
    start = time.time()
    rows: list[dict] = []
    torch.manual_seed(spec.train.seed)  # the run's own initialisation
    rows += [{**r, "step": 0} for r in probe_model(build_model(spec.model).eval(), idx, "init", settings, full=False)]
    if summary["status"] == "ok":
        trained = probe_model(load_final_model(spec.model, run_dir).eval(), idx, "trained", settings, full=True)
        rows += [{**r, "step": summary["steps"]} for r in trained]
    if settings["at_steps"]:  # diverged runs too: their snapshots end before the divergence
        rows += snapshot_rows(spec, run_dir, idx, settings)
    df = pd.DataFrame(rows, columns=["probe", "stage", "i", "j", "value", "step"])
    df.insert(0, "run_id", spec.run_id)
    df["status"] = summary["status"]
    atomic_write(out_path, lambda tmp: df.to_parquet(tmp, index=False))
    return {"run_id": spec.run_id, "rows": len(df), "seconds": round(time.time() - start, 2)}
