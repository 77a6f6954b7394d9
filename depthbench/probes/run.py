"""The probe stage of one run: load its final weights, draw the fixed validation sample, compute
every probe that applies to its architecture, write tidy rows to one Parquet file.

Tidy form: one row per (probe, stage, i, j) with `value`; `stage` is "trained" or "init"
(the same architecture and seed, freshly initialised) or "init_no_prefix_avg"; i and j are
layer (or sublayer / source) indices, -1 where unused. Summary probes (shares above threshold,
fraction of useful layers, residual-product rank, dead zone) are rows too.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from depthbench.config import RunSpec
from depthbench.data.shards import read_meta, split_files
from depthbench.io import atomic_write
from depthbench.models import build_model
from depthbench.probes import core
from depthbench.train.checkpoint import load_final_model

DEFAULTS: dict[str, Any] = {
    "n_sequences": 16,
    "seq_len": None,  # None: the run's training sequence length
    "seed": 0,
    "causal_threshold": 0.45,
    "permutation_threshold": 0.15,
    "usefulness_threshold": 1.1,
    "dead_zone_threshold": 0.05,
    "threads": 1,
}


def probe_sample(data_dir: str, n_sequences: int, seq_len: int, seed: int) -> torch.Tensor:
    """The fixed, seeded sample: n windows of seq_len + 1 tokens from the validation split."""
    meta = read_meta(data_dir)
    tokens = np.concatenate([np.memmap(f, dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r") for f in split_files(data_dir, meta, "val")])
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


def dead_zone(depth_weights: list[torch.Tensor], n_layer: int, n_blocks: int, threshold: float) -> tuple[int, list[float]]:
    """attnres_block: per layer, the weight its sublayers put on the current partial sum, and the
    dead-zone length: the number of leading layers whose weight is below `threshold`.

    A layer's weight is the mean over its sublayers that have a partial sum to weigh: the FFN
    sublayer always has one (at least the same layer's attention output), the attention sublayer
    unless the layer starts a block. So the weight is defined for every layer, also when every
    layer is its own block (n_blocks >= n_layer). The partial sum is the last source of a
    sublayer's depth softmax (see BlockSources.read)."""
    from depthbench.models.archs.attnres_block import block_ends

    starts = {1} | {e + 1 for e in block_ends(n_layer, n_blocks)}
    weights = []
    for l in range(1, n_layer + 1):
        attn, ffn = depth_weights[2 * (l - 1)], depth_weights[2 * (l - 1) + 1]
        parts = [float(ffn[-1])] + ([] if l in starts else [float(attn[-1])])
        weights.append(sum(parts) / len(parts))
    length = 0
    for w in weights:
        if w >= threshold:
            break
        length += 1
    return length, weights


@torch.no_grad()
def probe_model(model, idx: torch.Tensor, stage: str, settings: dict, full: bool) -> list[dict]:
    rows: list[dict] = []
    arch, L = model.arch_name, model.cfg.n_layer
    out = model(idx[:, :-1], return_hidden=True, return_internals=True)
    hidden = [h.float() for h in out.hidden]
    rows += _rows("token_similarity", stage, torch.tensor(core.token_similarity_by_layer(hidden)))
    rows += _rows("token_similarity_no_pos0", stage, torch.tensor(core.token_similarity_by_layer(hidden, skip_first=True)))
    if stage == "init" and arch != "moda":
        with core.without_prefix_average(model):
            h2 = core.residual_stream(model, idx[:, :-1])
        rows += _rows("token_similarity", "init_no_prefix_avg", torch.tensor(core.token_similarity_by_layer(h2)))
        rows += _rows("token_similarity_no_pos0", "init_no_prefix_avg", torch.tensor(core.token_similarity_by_layer(h2, skip_first=True)))
    if not full:
        return rows
    rows += _rows("effective_rank", stage, torch.tensor(core.effective_rank_by_layer(hidden)))
    rows += _rows("angular_distance_last", stage, core.angular_distance(hidden, last_token_only=True))
    rows += _rows("angular_distance_all", stage, core.angular_distance(hidden, last_token_only=False))
    workers = int(settings.get("threads", 1))  # the passes of one probe run in that many threads
    C = core.causal_scores(model, idx[:, :-1], workers)
    rows += _rows("causal_score", stage, C)
    rows.append(_scalar("causal_share", stage, core.share_above(C, settings["causal_threshold"])))
    P = core.permutation_scores(model, idx, workers)
    rows += _rows("permutation_score", stage, P)
    rows.append(_scalar("permutation_share", stage, core.share_above(P, settings["permutation_threshold"])))
    if not arch.startswith("attnres"):
        r = core.usefulness_ratios(model, idx, workers)
        rows += _rows("usefulness_ratio", stage, r)
        rows.append(_scalar("useful_fraction", stage, float((r[1:] > settings["usefulness_threshold"]).float().mean())))
    if arch in ("hc", "mhc"):
        rows.append(_scalar("residual_product_rank", stage, core.residual_product_rank(out.internals["stream_mixing"])))
    if arch.startswith("attnres"):
        for s, w in enumerate(out.internals["depth_weights"], start=1):
            for i, v in enumerate(w.tolist()):
                rows.append({"probe": "depth_weight", "stage": stage, "i": s, "j": i, "value": v})
        if arch == "attnres_block":
            n_blocks = int(model.cfg.arch_options.get("n_blocks", 8))
            length, weights = dead_zone(out.internals["depth_weights"], L, n_blocks, settings["dead_zone_threshold"])
            rows += _rows("partial_sum_weight", stage, torch.tensor([float("nan")] + weights))
            rows.append(_scalar("dead_zone_layers", stage, length))
    return rows


def run_probes(spec_dict: dict, data_dir: str, run_dir: str, out_path: str, settings: dict) -> dict:
    """Probe one run (trained weights, and its initialisation) and write its Parquet file."""
    settings = {**DEFAULTS, **settings}
    torch.set_num_threads(int(settings["threads"]))
    spec = RunSpec.from_dict(spec_dict)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    seq_len = settings["seq_len"] or spec.train.seq_len
    idx = probe_sample(data_dir, settings["n_sequences"], min(seq_len, spec.model.max_seq_len), settings["seed"])
    start = time.time()
    rows: list[dict] = []
    torch.manual_seed(spec.train.seed)  # the run's own initialisation
    rows += probe_model(build_model(spec.model).eval(), idx, "init", settings, full=False)
    if summary["status"] == "ok":
        rows += probe_model(load_final_model(spec.model, run_dir).eval(), idx, "trained", settings, full=True)
    df = pd.DataFrame(rows, columns=["probe", "stage", "i", "j", "value"])
    df.insert(0, "run_id", spec.run_id)
    df["status"] = summary["status"]
    atomic_write(out_path, lambda tmp: df.to_parquet(tmp, index=False))
    return {"run_id": spec.run_id, "rows": len(df), "seconds": round(time.time() - start, 2)}
