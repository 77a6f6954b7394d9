"""Synthetic result tables with the columns the workflow writes, for the analysis tests."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

BUDGET = 8.0e5
FLOOR = 5.5  # the synthetic unigram floor (nats)
JITTER = 1e-3  # seed s adds s * JITTER to every measured value: seeds differ, seed 0 is the base
HALF_WIDTH = 5e-3  # with intervals=True: each row's ci_low / ci_high are value -+ this


def _run_id(arch: str, L: int, lr: float, seed: int = 0) -> str:
    return f"{arch}_L{L}_lr{lr:g}_s{seed}"


def synthetic_tables(
    archs=("pre_ln", "hc", "attnres_block"),
    depths=(2, 4, 8),
    lrs=(2e-3, 4e-3),
    diverged=lambda arch, L, lr: lr > 3e-3 and arch == "hc",
    loss=None,
    seeds=(0,),
    intervals=False,
) -> dict[str, pd.DataFrame]:
    """A complete set of tables: runs (status from `diverged`), best_lr, curves, dynamics,
    probes (trained and init), nll and cost. loss(arch, L, lr) gives each run's final loss; each
    seed adds seed * JITTER to the measured values. `intervals`: the probe and NLL rows carry
    ci_low / ci_high (value -+ HALF_WIDTH) and best_lr ci_low / ci_high / n, as the stages that
    write intervals do."""
    from depthbench.analysis.readers import learned

    loss = loss or (
        lambda arch, L, lr: 4.0 + 0.1 * abs(np.log2(lr / 2e-3)) - 0.02 * L * (arch != "pre_ln")
    )
    runs = []
    for arch, L, lr, seed in itertools.product(archs, depths, lrs, seeds):
        d = int(64 * np.sqrt(8 / L) // 16 * 16)
        bad = diverged(arch, L, lr)
        final = np.nan if bad else loss(arch, L, lr) + JITTER * seed
        runs.append(
            {
                "run_id": _run_id(arch, L, lr, seed),
                "experiment": "syn",
                "arch": arch,
                "n_layer": L,
                "d_model": d,
                "ratio": d / L,
                "params": int(BUDGET * (1 + 0.01 * (L - 4))),
                "lr": lr,
                "seed": seed,
                "knobs": "{}",
                "n_head": 4,
                "n_kv_head": 4,
                "status": "diverged" if bad else "ok",
                "final_val_loss": final,
                "unigram_floor": FLOOR,
                "learned": learned(final, FLOOR, 0.1),
                "device": "cpu",
            }
        )
    runs = pd.DataFrame(runs)
    from depthbench.analysis.tables import best_learning_rates

    best = best_learning_rates(runs)
    tables = {"runs": runs, "best_lr": best}
    curves, dyn, probes = [], [], []
    for r in runs.itertuples():
        for step in range(0, 101, 10):
            curves.append(
                {
                    "run_id": r.run_id,
                    "step": step,
                    "tokens": step * 2048,
                    "train_loss": 7 - step / 30,
                    "val_loss": 7 - step / 30 if step % 50 == 0 else np.nan,
                }
            )
        for step in (50, 100):
            for l in range(r.n_layer + 1):
                dyn.append(
                    {
                        "run_id": r.run_id,
                        "step": step,
                        "quantity": "residual_rms",
                        "index": l,
                        "name": "",
                        "value": 1 + l * step / 100 + JITTER * r.seed,
                    }
                )
                dyn.append(
                    {
                        "run_id": r.run_id,
                        "step": step,
                        "quantity": "grad_norm_h",
                        "index": l,
                        "name": "",
                        "value": 0.1 / (1 + l) + JITTER * r.seed,
                    }
                )
            for l in range(r.n_layer):
                dyn.append(
                    {
                        "run_id": r.run_id,
                        "step": step,
                        "quantity": "norm_factor",
                        "index": -1,
                        "name": f"blocks.{l}.attn_norm",
                        "value": 1 / (1 + l) + JITTER * r.seed,
                    }
                )
        probes += _probe_rows(r)
    tables["curves"] = pd.DataFrame(curves)
    tables["dynamics"] = pd.DataFrame(dyn)
    probes = pd.DataFrame(probes)
    from depthbench.analysis.stage_tables import with_run_columns

    tables["probes"] = with_run_columns(probes, runs, best)
    nll = pd.DataFrame(
        [
            {
                "run_id": r.run_id,
                "level": "domain",
                "set": "",
                "domain": dom,
                "n_docs": 16,
                "nats_per_token": 3.0 + JITTER * r.seed,
                "bits_per_byte": 1.5 - 0.01 * r.n_layer + JITTER * r.seed,
            }
            for r in runs.itertuples()
            for dom in ("code", "stem", "math")
        ]
    )
    tables["nll"] = with_run_columns(nll, runs, best)
    if intervals:
        for name, column in (("probes", "value"), ("nll", "bits_per_byte")):
            df = tables[name]
            df["ci_low"], df["ci_high"] = df[column] - HALF_WIDTH, df[column] + HALF_WIDTH
        best["ci_low"] = best["final_val_loss"] - HALF_WIDTH
        best["ci_high"] = best["final_val_loss"] + HALF_WIDTH
        best["n"] = best["n_seeds"]
    cost = pd.DataFrame(
        [
            {
                "run_id": r.run_id,
                "prefill_flops_4096": 1e9 * r.n_layer,
                "kv_cache_bytes_4096": 2**20 * r.n_layer,
                "measured_peak_memory_bytes": 5e8,
                "peak_memory_kind": "process_max_rss",
                "device_hours": 0.01,
                "device": "cpu",
            }
            for r in runs.itertuples()
        ]
    )
    tables["cost"] = (
        with_run_columns(cost, runs, best)
        .merge(runs[["run_id", "device"]].rename(columns={"device": "d2"}), on="run_id")
        .drop(columns="d2")
    )
    removal = []  # the loss rises with the fraction removed, faster for pre_ln
    for r in runs[runs.status == "ok"].itertuples():
        for ranking in ("angular_block", "block_influence", "causal", "last", "random"):
            for k in range(r.n_layer):
                for domain in ("val", "code"):
                    change = (k / r.n_layer) ** 2 * (1.0 if r.arch == "pre_ln" else 2.0)
                    removal.append(
                        {
                            "run_id": r.run_id,
                            "ranking": ranking,
                            "draw": 0,
                            "k": k,
                            "fraction": k / r.n_layer,
                            "removed": "",
                            "domain": domain,
                            "loss": 4.0 * (1 + change),
                            "full_loss": 4.0,
                            "change": change,
                            "status": "ok",
                        }
                    )
    from depthbench.probes.effective_depth import COLUMNS, effective_depth

    columns = ["run_id", *COLUMNS, "status"]
    tables["removal"] = with_run_columns(pd.DataFrame(removal, columns=columns), runs, best)
    tables["effective_depth"] = with_run_columns(
        effective_depth(pd.DataFrame(removal, columns=columns), 0.05), runs, best
    )
    return tables


def _probe_rows(r) -> list[dict]:
    L, rows = r.n_layer, []
    stages = ("init", "init_no_prefix_avg") + (("trained",) if r.status == "ok" else ())
    for stage in stages:

        def add(probe, i, j, v, stage=stage):
            rows.append(
                {
                    "run_id": r.run_id,
                    "probe": probe,
                    "stage": stage,
                    "i": i,
                    "j": j,
                    "value": v + JITTER * r.seed,
                }
            )

        for l in range(L + 1):
            add("token_similarity", l, -1, 0.1 * l)
            add("effective_rank", l, -1, 20 - l)
            for k in range(L + 1 - l):
                add("angular_distance_last", l, k, 0.05 * k)
                add("angular_distance_all", l, k, 0.04 * k)
        if stage == "init_no_prefix_avg":
            continue
        for l in range(L + 1):  # the lens approaches the final prediction with depth
            add("lens_cross_entropy", l, -1, 6.0 - 2.0 * l / L)
            add("lens_kl_to_final", l, -1, 2.0 * (1 - l / L))
            add("lens_top1_agreement", l, -1, l / L)
        for s in range(1, L + 1):
            for l in range(s + 1, L + 1):
                add("causal_score", s, l, 0.6 if l == s + 1 else 0.1)
                add("permutation_score", s, l, 0.2 if r.arch == "hc" else 0.05)
        add("causal_share", -1, -1, 0.3 if r.arch != "pre_ln" else 0.05)
        add("permutation_share", -1, -1, 0.4 if r.arch == "hc" else 0.1)
        if not r.arch.startswith("attnres"):
            for l in range(1, L + 1):
                add("usefulness_ratio", l, -1, 1.0 + 0.05 * l)
        if r.arch in ("hc", "mhc"):
            add("residual_product_rank", -1, -1, 2.6 if r.arch == "hc" else 1.5)
        if r.arch.startswith("attnres"):
            for s in range(1, 2 * L + 2):
                for j in range(min(s, 4)):
                    add("depth_weight", s, j, 1 / min(s, 4))
            if r.arch == "attnres_block":
                for l in range(1, L + 1):
                    add("partial_sum_weight", l, -1, 0.01 if l <= L // 4 else 0.3)
                add("dead_zone_layers", -1, -1, float(L // 4))
    if r.status == "ok":  # probes over training (probes.at_steps); the last step is the final model
        for step in (10, 50, 100):

            def snap(probe, i, j, v, step=step):
                rows.append(
                    {
                        "run_id": r.run_id,
                        "probe": probe,
                        "stage": "snapshot",
                        "step": step,
                        "i": i,
                        "j": j,
                        "value": v,
                    }
                )

            for l in range(L + 1):
                snap("token_similarity", l, -1, 0.1 * l * step / 100)
                for k in range(L + 1 - l):
                    snap("angular_distance_last", l, k, 0.05 * k * step / 100)
            snap("causal_share", -1, -1, (0.3 if r.arch != "pre_ln" else 0.05) * step / 100)
            snap("permutation_share", -1, -1, (0.4 if r.arch == "hc" else 0.1) * step / 100)
    return rows
