"""The removal stage of one run: its layer-removal curves (depthbench.probes.removal), as tidy rows.

The rankings come from the run's probe rows (the angular distances, block influence and causal
scores of the probe sample, computed once in the probe stage's baseline pass); the losses are
measured on data held apart from that sample: `removal.n_sequences` validation windows that the
probe sample does not contain, and up to `removal.docs_per_domain` documents of each NLL domain
(code, STEM, math), scored on their continuations as the NLL stage scores them.

One row per (ranking, draw, k, domain): `loss` (mean nats per scored token), `full_loss` (the
model with every layer), `change` = loss / full_loss - 1, `removed` (the layers, "2,5,6"); each
ranking has a k = 0 row, the full model, where its curve starts.

Like the probes, the losses are measured on the run's device (`train.device`, operational) in
float32; the returned report names the device.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from depthbench.util.io import atomic_write
from depthbench.probes.effective_depth import COLUMNS
from depthbench.spec.schema import schema_defaults

# torch (and depthbench.probes.removal, which needs it) only where a model is scored: the job of
# a diverged run writes its empty rows without them, as its NLL job does
if TYPE_CHECKING:
    import torch

    from depthbench.probes.removal import ScoredTokens


def removal_settings(settings: dict) -> dict:
    """The schema's removal defaults, the operational thread count (1 unless the dispatcher passes
    the cores of the job), then `settings`."""
    return {**schema_defaults("removal"), "threads": 1, **settings}


def held_apart_windows(
    tokens: np.ndarray, seq_len: int, probe_n: int, probe_seed: int, n: int, seed: int
) -> torch.Tensor:
    """n seeded windows of seq_len + 1 tokens that the probe sample (drawn as
    depthbench.probes.run.probe_sample draws it) does not contain."""
    n_windows = (len(tokens) - 1) // seq_len
    probe_picks = set(
        np.random.default_rng(probe_seed)
        .choice(n_windows, size=min(probe_n, n_windows), replace=False)
        .tolist()
    )
    rest = np.array(sorted(set(range(n_windows)) - probe_picks))
    if len(rest) == 0:
        raise ValueError(
            f"the validation split has {n_windows} windows of {seq_len + 1} tokens "
            "and the probe sample "
            "takes them all: none is left for the removal losses (lower probes.n_sequences)"
        )
    picks = sorted(
        np.random.default_rng(seed).choice(rest, size=min(n, len(rest)), replace=False).tolist()
    )
    import torch

    return torch.from_numpy(
        np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64) for i in picks])
    )


def domain_documents(docs: pd.DataFrame, per_domain: int, seed: int) -> dict[str, pd.DataFrame]:
    """Up to `per_domain` seeded documents of each domain of a tokenized NLL set table."""
    out = {}
    for domain, group in docs.groupby("domain", sort=True):
        if len(group) > per_domain:
            group = group.iloc[
                sorted(
                    np.random.default_rng(seed).choice(len(group), size=per_domain, replace=False)
                )
            ]
        out[str(domain)] = group
    return out


def ranking_inputs(
    probes: pd.DataFrame, n_layer: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(BI_l for l = 1 .. L, the last-token angular distance matrix, the causal score matrix) from
    a run's trained probe rows."""
    import torch

    trained = probes[probes["stage"] == "trained"]

    def matrix(name: str) -> torch.Tensor:
        M = torch.full((n_layer + 1, n_layer + 1), float("nan"), dtype=torch.float64)
        rows = trained[trained["probe"] == name]
        if rows.empty:
            raise ValueError(
                f"the probe rows have no trained {name!r}: the removal rankings need them"
            )
        M[rows["i"].to_numpy(), rows["j"].to_numpy()] = torch.from_numpy(
            rows["value"].to_numpy(dtype=np.float64)
        )
        return M

    bi = trained[trained["probe"] == "block_influence"].sort_values("i")
    if sorted(bi["i"]) != list(range(1, n_layer + 1)):
        raise ValueError(
            "the probe rows have no trained 'block_influence' for layers 1 .. L "
            "(probe files written "
            "before it existed: rerun the probe stage)"
        )
    return (
        torch.from_numpy(bi["value"].to_numpy(dtype=np.float64)),
        matrix("angular_distance_last"),
        matrix("causal_score"),
    )


def removal_rows(
    adapter, probes: pd.DataFrame, data: dict[str, ScoredTokens], settings: dict
) -> pd.DataFrame:
    """Every ranking's removal curve of the model on each domain of `data` (module docstring)."""
    import torch

    from depthbench.probes.removal import RANKINGS, layer_counts, removal_losses, removal_sets

    L = adapter.n_layer
    if L >= 2:
        influence, distance, causal = ranking_inputs(probes, L)
        sets = removal_sets(
            influence, distance, causal, L, layer_counts(L, settings["fractions"]), settings["seed"]
        )
    else:
        # one layer: nothing can be removed with a layer kept; each ranking's curve is its
        # k = 0 point
        sets = []
    with torch.no_grad():
        full, measured = removal_losses(adapter, sets, data)
    rankings = sorted(RANKINGS)
    rows = [{"ranking": r, "draw": 0, "k": 0, "removed": []} | full for r in rankings] + measured
    out = []
    for row in rows:
        for domain in data:
            out.append(
                {
                    "ranking": row["ranking"],
                    "draw": row["draw"],
                    "k": row["k"],
                    "fraction": row["k"] / L,
                    "removed": ",".join(str(x) for x in row["removed"]),
                    "domain": domain,
                    "loss": row[domain],
                    "full_loss": full[domain],
                    "change": row[domain] / full[domain] - 1,
                }
            )
    return pd.DataFrame(out, columns=COLUMNS)


def _write(df: pd.DataFrame, run_id: str, status: str, out_path: str) -> None:
    df.insert(0, "run_id", run_id)
    df["status"] = status
    atomic_write(out_path, lambda tmp: df.to_parquet(tmp, index=False))


def run_removal(
    spec_dict: dict,
    data_dir: str,
    run_dir: str,
    probes_path: str,
    sets_path: str,
    out_path: str,
    settings: dict,
    probe_settings: dict,
) -> dict:
    """The removal rows of one trained run (its final weights), written to `out_path`."""
    from depthbench.train.runcheck import check_run
    from depthbench.spec.run import RunSpec

    settings = removal_settings(settings)
    spec = RunSpec.from_dict(spec_dict)
    summary = check_run(run_dir, spec)
    start = time.time()
    if summary["status"] != "ok":  # diverged: no meaningful weights, no rows (and no torch)
        _write(pd.DataFrame(columns=COLUMNS), spec.run_id, summary["status"], out_path)
        return {"run_id": spec.run_id, "rows": 0, "seconds": 0.0}
    import torch

    from depthbench.probes.removal import ScoredTokens
    from depthbench.probes.run import validation_tokens
    from depthbench.kernels.swap import swap_in
    from depthbench.train.checkpoint import load_final_model
    from depthbench.train.recipe import resolve_device

    torch.set_num_threads(int(settings["threads"]))
    device = resolve_device(spec.train.device)
    seq_len = min(probe_settings.get("seq_len") or spec.train.seq_len, spec.model.max_seq_len)
    val = held_apart_windows(
        validation_tokens(data_dir),
        seq_len,
        probe_settings["n_sequences"],
        probe_settings["seed"],
        settings["n_sequences"],
        settings["seed"],
    )
    data = {"val": ScoredTokens.windows(val)}
    window = min(spec.train.seq_len, spec.model.max_seq_len)
    for domain, docs in domain_documents(
        pd.read_parquet(sets_path), settings["docs_per_domain"], settings["seed"]
    ).items():
        data[domain] = ScoredTokens.documents(docs, window)
    model = swap_in(load_final_model(spec.model, run_dir).to(device).eval())
    data = {domain: scored.to(device) for domain, scored in data.items()}
    df = removal_rows(model, pd.read_parquet(probes_path), data, settings)
    _write(df, spec.run_id, summary["status"], out_path)
    return {
        "run_id": spec.run_id,
        "rows": len(df),
        "seconds": round(time.time() - start, 2),
        "device": str(device),
    }
