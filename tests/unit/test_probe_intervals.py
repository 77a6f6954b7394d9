"""The probe rows' 95% intervals (depthbench.probes.spread, measure.probe_model) against
computations that do not share their code: bootstrap_mean of per-sequence values measured one
sequence at a time, the probes recomputed on a resampled batch, share_above per resample."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from depthbench.analysis.intervals import bootstrap_mean
from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.probes import core, interventions, spread
from depthbench.probes.measure import probe_model
from depthbench.probes.run import probe_settings
from depthbench.util.resample import resample_counts

N, T, SEED = 6, 12, 7
IDX = torch.randint(0, 50, (N, T + 1), generator=torch.Generator().manual_seed(1))


def model(arch="pre_ln", n_layer=4, **kw):
    torch.manual_seed(0)
    return build_model(
        ModelConfig(
            arch=arch,
            vocab_size=50,
            d_model=32,
            n_layer=n_layer,
            n_head=4,
            max_seq_len=16,
            init_std=0.1,
            **kw,
        )
    ).eval()


def rows(m, stage="trained", full=True, seed=SEED) -> pd.DataFrame:
    settings = probe_settings({"bootstrap_seed": seed})
    return pd.DataFrame(probe_model(m, IDX, stage, settings, full=full))


def row(df: pd.DataFrame, probe: str, i: int = -1, j: int = -1) -> pd.Series:
    hit = df[(df["probe"] == probe) & (df["i"] == i) & (df["j"] == j)]
    assert len(hit) == 1, (probe, i, j)
    return hit.iloc[0]


def resampled_batches(seed: int, count: int) -> list[torch.Tensor]:
    """The sequence indices of the first `count` resamples, from numpy's draws themselves."""
    draws = np.random.default_rng(seed).integers(0, N, size=(1000, N))
    return [torch.from_numpy(np.sort(d)) for d in draws[:count]]


def one_at_a_time(m, fn) -> np.ndarray:
    """fn(h_0..h_L of one sequence) for each sequence alone, stacked on the last axis."""
    return np.stack(
        [np.asarray(fn(core.residual_stream(m, IDX[n : n + 1, :-1]))) for n in range(N)], -1
    )


@pytest.fixture(scope="module")
def pre_ln():
    m = model()
    return m, rows(m)


def test_mean_probes_have_the_bootstrap_interval_of_their_per_sequence_values(pre_ln):
    m, df = pre_ln
    L = m.n_layer
    angular = one_at_a_time(m, lambda h: core.angular_distance(h, last_token_only=True).numpy())
    tsim = one_at_a_time(m, core.token_similarity_by_layer)
    erank = one_at_a_time(m, core.effective_rank_by_layer)
    cases = [(row(df, "angular_distance_last", l, k), angular[l, k]) for l, k in ((0, 1), (2, 2))]
    cases += [(row(df, "token_similarity", l), tsim[l]) for l in (1, L)]
    cases += [(row(df, "effective_rank", l), erank[l]) for l in (0, L)]
    late = angular[L // 2 : L, 1].mean(axis=0)  # mean d(l, l+1) over l = L//2 .. L-1
    cases.append((row(df, "angular_distance_late"), late))
    for r, per_seq in cases:
        e = bootstrap_mean(per_seq, seed=SEED)
        assert r["ci_low"] == pytest.approx(e.low, rel=1e-4, abs=1e-6), r["probe"]
        assert r["ci_high"] == pytest.approx(e.high, rel=1e-4, abs=1e-6), r["probe"]
        assert r["ci_low"] <= r["value"] <= r["ci_high"]


def test_values_are_the_probes_own(pre_ln):
    m, df = pre_ln
    hidden = core.residual_stream(m, IDX[:, :-1])
    tsim = df[df["probe"] == "token_similarity"].sort_values("i")["value"].to_numpy()
    erank = df[df["probe"] == "effective_rank"].sort_values("i")["value"].to_numpy()
    np.testing.assert_array_equal(tsim, torch.tensor(core.token_similarity_by_layer(hidden)))
    np.testing.assert_array_equal(erank, torch.tensor(core.effective_rank_by_layer(hidden)))
    C = interventions.causal_scores(m, IDX[:, :-1])
    causal = df[df["probe"] == "causal_score"]
    at = causal["i"].to_numpy(), causal["j"].to_numpy()
    np.testing.assert_array_equal(causal["value"], C.numpy()[at])
    D = core.angular_distance(hidden)
    late = np.mean([float(D[l, 1]) for l in range(m.n_layer // 2, m.n_layer)])
    assert row(df, "angular_distance_late")["value"] == late


@pytest.mark.parametrize("arch", ["pre_ln", "hc"])
def test_resampled_causal_and_permutation_scores_are_the_probes_on_the_resampled_batch(arch):
    m = model(arch, n_layer=3)
    inputs = IDX[:, :-1]
    counts = resample_counts(N, SEED)
    _, A, B = interventions.causal_scores(m, inputs, per_sequence=True)
    _, S, base = interventions.permutation_scores(m, IDX, per_sequence=True)
    causal, permutation = spread.causal(A, B, counts), spread.permutation(S, base, counts)
    for b, pick in enumerate(resampled_batches(SEED, 3)):
        np.testing.assert_allclose(
            causal[..., b], interventions.causal_scores(m, inputs[pick]), rtol=1e-4, atol=1e-7
        )
        np.testing.assert_allclose(
            permutation[..., b],
            interventions.permutation_scores(m, IDX[pick]),
            rtol=1e-3,
            atol=5e-6,
        )


def test_share_intervals_are_the_quantiles_of_share_above_per_resample(pre_ln):
    m, df = pre_ln
    counts = resample_counts(N, SEED)
    C, A, B = interventions.causal_scores(m, IDX[:, :-1], per_sequence=True)
    resampled = spread.causal(A, B, counts)
    shares = [core.share_above(torch.from_numpy(resampled[..., b]), 0.45) for b in range(1000)]
    np.testing.assert_array_equal(spread.shares(resampled, 0.45), shares)  # the same floats
    low, high = np.quantile(shares, [0.025, 0.975])
    r = row(df, "causal_share")
    assert r["value"] == core.share_above(C, 0.45)
    assert (r["ci_low"], r["ci_high"]) == (pytest.approx(low), pytest.approx(high))


def test_usefulness_interval_resamples_the_losses_with_the_whole_samples_fits(pre_ln):
    m, df = pre_ln
    r, R, base = interventions.usefulness_ratios(m, IDX, per_sequence=True)
    # r_l is the ratio of the mean losses over sequences (every sequence has T tokens)
    np.testing.assert_allclose(R[1:].mean(-1) / base.mean(), r[1:].double(), rtol=1e-5)
    draws = np.random.default_rng(SEED).integers(0, N, size=(1000, N))
    ratios = R[2].numpy()[draws].mean(1) / base.numpy()[draws].mean(1)
    low, high = np.quantile(ratios, [0.025, 0.975])
    got = row(df, "usefulness_ratio", 2)
    assert (got["ci_low"], got["ci_high"]) == (pytest.approx(low), pytest.approx(high))


def test_rms_rows_against_the_stream():
    m = model()
    df = rows(m, stage="init", full=False)
    hidden = core.residual_stream(m, IDX[:, :-1])
    rms = [float(h.double().pow(2).mean().sqrt()) for h in hidden]
    got = df[df["probe"] == "residual_rms"].sort_values("i")
    np.testing.assert_allclose(got["value"], rms, rtol=1e-6)
    draws = np.random.default_rng(SEED).integers(0, N, size=(1000, N))
    square = [h.double().pow(2).mean(dim=(1, 2)).numpy() for h in hidden]
    growth = np.sqrt(square[-1][draws].mean(1) / square[0][draws].mean(1))
    low, high = np.quantile(growth, [0.025, 0.975])
    g = row(df, "rms_growth")
    assert g["value"] == pytest.approx(rms[-1] / rms[0], rel=1e-6)
    assert (g["ci_low"], g["ci_high"]) == (pytest.approx(low), pytest.approx(high))


def test_residual_product_rank_interval_is_over_sequences():
    m = model("mhc", n_layer=2)
    df = rows(m, stage="init", full=False)
    per_seq = [
        core.residual_product_rank(m.records(IDX[n : n + 1, :-1])["stream_mixing"])
        for n in range(N)
    ]
    e = bootstrap_mean(per_seq, seed=SEED)
    r = row(df, "residual_product_rank")
    assert (r["ci_low"], r["ci_high"]) == (pytest.approx(e.low), pytest.approx(e.high))


def test_dead_zone_of_a_resample_is_the_dead_zone_of_the_resampled_batch():
    m = model("attnres_block", n_layer=4, arch_options={"n_blocks": 2})
    inputs = IDX[:, :-1]
    counts = resample_counts(N, SEED)
    by_seq = [m.records(inputs[n : n + 1])["depth_weights"] for n in range(N)]
    lengths, weights = spread.dead_zones(m, by_seq, 0.3, counts)
    for b, pick in enumerate(resampled_batches(SEED, 3)):
        length, w = m.dead_zone(m.records(inputs[pick])["depth_weights"], 0.3)
        assert lengths[b] == length
        np.testing.assert_allclose(weights[:, b], w, rtol=1e-5)
    df = rows(m)
    for probe in ("dead_zone_layers", "partial_sum_weight"):
        part = df[df["probe"] == probe]
        assert part[["ci_low", "ci_high"]].notna().all().all(), probe


def test_intervals_are_seeded_and_the_same_bit_for_bit(pre_ln):
    m, df = pre_ln
    again = rows(m)
    pd.testing.assert_frame_equal(df, again, check_exact=True)
    other = rows(m, seed=SEED + 1)
    pd.testing.assert_series_equal(df["value"], other["value"], check_exact=True)
    assert not df["ci_low"].equals(other["ci_low"])


def test_rows_without_an_interval_say_so_with_nan(pre_ln):
    _, df = pre_ln
    none = df[df["probe"].isin(["block_influence", "lens_cross_entropy"])]
    assert len(none) and none[["ci_low", "ci_high"]].isna().all().all()
    some = df[~df["probe"].isin(["block_influence"]) & ~df["probe"].str.startswith("lens_")]
    assert some[["ci_low", "ci_high"]].notna().all().all()


def test_one_sequence_has_no_interval():
    m = model(n_layer=2)
    settings = probe_settings({"bootstrap_seed": SEED})
    df = pd.DataFrame(probe_model(m, IDX[:1], "trained", settings, full=True))
    assert df[["ci_low", "ci_high"]].isna().all().all() and df["value"].notna().all()
