"""The probe stage of one run: load its final weights, draw the fixed validation sample, compute
every probe that applies to its architecture, write tidy rows to one Parquet file.

Tidy form: one row per (probe, stage, i, j) with `value`; `stage` is "trained" or "init"
(the same architecture and seed, freshly initialised) or "init_no_prefix_avg"; i and j are
layer (or sublayer / source) indices, -1 where unused; `step` is the number of updates of the
weights probed (0 at init, the run's last step for "trained"). Summary probes (shares above
threshold, fraction of useful layers, residual-product rank, dead zone, the mean late-layer
angular distance, RMS growth) are rows too. With probes.at_steps the run's snapshots add rows of
stage "snapshot" at their steps (depthbench.probes.steps).

`ci_low` and `ci_high` are each row's 95% interval, a percentile bootstrap over the sample's
sequences (depthbench.probes.spread), NaN where the row has none; the bootstrap is seeded with
the run's seed, so the file is the same bit for bit on a rerun.

The probes run on the run's device (`train.device`, operational: auto is CUDA where there is
one), in float32 without autocast whatever the run trained in, so that CPU and GPU measure the
same model; the returned report names the device.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch

from depthbench.spec.schema import schema_defaults
from depthbench.data.shards import read_meta, split_files
from depthbench.util.io import atomic_write
from depthbench.models.registry import build_model
from depthbench.kernels.swap import swap_in
from depthbench.probes.measure import probe_model
from depthbench.probes.steps import snapshot_rows
from depthbench.train.runcheck import check_run
from depthbench.spec.run import RunSpec
from depthbench.train.checkpoint import load_final_model


def probe_settings(settings: dict) -> dict:
    """The schema's probe defaults, then the operational thread count (1 unless the dispatcher
    passes the cores of the job) and the intervals' bootstrap seed (0 unless the stage passes
    the run's seed), then `settings`."""
    return {**schema_defaults("probes"), "threads": 1, "bootstrap_seed": 0, **settings}


def validation_tokens(data_dir: str) -> np.ndarray:
    """The validation split's token stream, in shard order."""
    meta = read_meta(data_dir)
    return np.concatenate(
        [
            np.memmap(f, dtype=np.dtype(meta["dtype"]).newbyteorder("<"), mode="r")
            for f in split_files(data_dir, meta, "val")
        ]
    )


def probe_sample(data_dir: str, n_sequences: int, seq_len: int, seed: int) -> torch.Tensor:
    """The fixed, seeded sample: n windows of seq_len + 1 tokens from the validation split."""
    tokens = validation_tokens(data_dir)
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows < 1:
        raise ValueError(
            f"{data_dir}: validation split shorter than one probe window of {seq_len + 1} tokens"
        )
    rng = np.random.default_rng(seed)
    picks = rng.choice(n_windows, size=min(n_sequences, n_windows), replace=False)
    return torch.from_numpy(
        np.stack(
            [
                tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64)
                for i in sorted(picks)
            ]
        )
    )


def run_probes(spec_dict: dict, data_dir: str, run_dir: str, out_path: str, settings: dict) -> dict:
    """Probe one run (trained weights, and its initialisation) and write its Parquet file."""
    from depthbench.train.recipe import resolve_device

    spec = RunSpec.from_dict(spec_dict)
    settings = {**probe_settings(settings), "bootstrap_seed": spec.train.seed}
    torch.set_num_threads(int(settings["threads"]))
    summary = check_run(run_dir, spec)  # identity and weights, before any work
    device = resolve_device(spec.train.device)
    seq_len = settings["seq_len"] or spec.train.seq_len
    idx = probe_sample(
        data_dir, settings["n_sequences"], min(seq_len, spec.model.max_seq_len), settings["seed"]
    ).to(device)
    start = time.time()
    rows: list[dict] = []
    torch.manual_seed(spec.train.seed)  # the run's own initialisation, built on the CPU
    init = swap_in(build_model(spec.model).to(device).eval())  # the device's implementations
    rows += [{**r, "step": 0} for r in probe_model(init, idx, "init", settings, full=False)]
    del init
    if summary["status"] == "ok":
        model = swap_in(load_final_model(spec.model, run_dir).to(device).eval())
        trained = probe_model(model, idx, "trained", settings, full=True)
        rows += [{**r, "step": summary["steps"]} for r in trained]
    if settings["at_steps"]:  # diverged runs too: their snapshots end before the divergence
        rows += snapshot_rows(spec, run_dir, idx, settings)
    df = pd.DataFrame(
        rows, columns=["probe", "stage", "i", "j", "value", "ci_low", "ci_high", "step"]
    )
    df.insert(0, "run_id", spec.run_id)
    df["status"] = summary["status"]
    atomic_write(out_path, lambda tmp: df.to_parquet(tmp, index=False))
    return {
        "run_id": spec.run_id,
        "rows": len(df),
        "seconds": round(time.time() - start, 2),
        "device": str(device),
    }
