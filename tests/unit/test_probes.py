"""Probe computations against cases whose answer is known exactly."""

import multiprocessing
import os
import sys

import pytest
import torch

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model
from depthbench.probes import workers
from depthbench.probes.core import (
    angular_distance,
    effective_rank,
    lm_loss,
    residual_product_rank,
    residual_stream,
    token_similarity,
)
from depthbench.probes.interventions import causal_scores, permutation_scores, usefulness_ratios
from depthbench.models.registry import PACKAGE_ARCHITECTURES


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
    )


def make_identity(m, layer):
    """pre_ln layer whose sublayers output zero: x + 0 + 0."""
    with torch.no_grad():
        m.blocks[layer - 1].attn.wo.weight.zero_()
        m.blocks[layer - 1].ffn.w2.weight.zero_()


IDX = torch.randint(0, 50, (6, 12), generator=torch.Generator().manual_seed(1))


def test_identity_layer_has_angular_distance_zero():
    m = model()
    make_identity(m, 2)
    for last in (True, False):
        D = angular_distance(residual_stream(m, IDX), last_token_only=last)
        assert D[1, 1].item() == pytest.approx(
            0.0, abs=1e-3
        )  # h_1 -> h_2 through the identity layer
        assert D[0, 0] == pytest.approx(0.0, abs=1e-3) and D[2, 1] > 0.01
        assert torch.isnan(D[4, 1])


def test_skipping_an_identity_layer_gives_causal_score_zero_and_others_do_not():
    m = model()
    make_identity(m, 2)
    C = causal_scores(m, IDX)
    assert torch.allclose(C[2, 3:], torch.zeros(2), atol=1e-6)
    assert (C[1, 3:] > 0.01).all()
    assert torch.isnan(C[1, 2])  # layer 2 changes nothing: its score is 0/0, undefined
    assert torch.isnan(C[3, 2]) and torch.isnan(C[0, 1])


@pytest.mark.parametrize(
    "arch", ["pre_ln", "post_ln", "hc", "attnres_full", "attnres_block", "moda"]
)
def test_causal_scores_take_one_baseline_pass_and_resume_each_skipped_pass(arch):
    L = 3
    m = model(arch, n_layer=L)
    calls = []  # layer evaluations: every architecture calls each layer's FFN sublayer once
    handles = [b.ffn.register_forward_hook(lambda *a: calls.append(1)) for b in m.blocks]
    causal_scores(m, IDX)
    for h in handles:
        h.remove()
    # the baseline pass, then for each skipped layer s < L a pass resumed after s: far fewer
    # than the (L + 1) L layer evaluations of L + 1 full passes
    assert len(calls) == L + sum(L - s for s in range(1, L)) < (L + 1) * L


def test_swapping_identical_layers_gives_permutation_score_zero_and_restores_weights():
    m = model()
    with torch.no_grad():
        m.blocks[2].load_state_dict(m.blocks[1].state_dict())
    P = permutation_scores(m, IDX)
    assert P[2, 3].item() == pytest.approx(0.0, abs=1e-7)
    assert P[1, 4] > 0
    reference = {k: v.clone() for k, v in m.state_dict().items()}
    with m.swapped(1, 4):
        assert not torch.equal(m.blocks[0].attn.wqkv.weight, reference["blocks.0.attn.wqkv.weight"])
    for k, v in m.state_dict().items():
        assert torch.equal(v, reference[k]), k


def test_lns_position_constants_stay_with_the_position_when_swapped():
    m = model("lns")
    scales = [b.scale for b in m.blocks]
    base = lm_loss(m, IDX)
    with m.swapped(1, 4):
        assert [b.scale for b in m.blocks] == scales
        assert lm_loss(m, IDX) != base


def test_effective_rank_of_rank_one_and_orthogonal_matrices():
    u, v = torch.randn(20, 1, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)
    assert effective_rank(u @ v) == pytest.approx(1.0, abs=1e-9)
    q, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    assert effective_rank(q) == pytest.approx(16.0, rel=1e-9)
    assert 1.0 < effective_rank(torch.randn(16, 16)) < 16.0


def test_token_similarity_of_identical_tokens_is_one():
    h = torch.randn(3, 1, 8).expand(3, 10, 8)
    assert token_similarity(h) == pytest.approx(1.0, abs=1e-6)
    opposite = torch.stack([torch.ones(8), -torch.ones(8)]).unsqueeze(0)
    assert token_similarity(opposite) == pytest.approx(-1.0, abs=1e-6)
    first_different = torch.cat([-torch.ones(1, 1, 8), torch.ones(1, 5, 8)], dim=1)
    assert token_similarity(first_different, skip_first=True) == pytest.approx(1.0)


def test_residual_product_rank_is_between_one_and_n():
    n = 4
    eye = torch.eye(n).expand(2, 3, n, n)
    assert residual_product_rank([eye, eye]) == pytest.approx(float(n))
    uniform = torch.full((2, 3, n, n), 1.0 / n)  # doubly stochastic, rank one
    assert residual_product_rank([eye, uniform]) == pytest.approx(1.0, abs=1e-6)
    m = model("mhc", n_layer=2)
    r = residual_product_rank(m.records(IDX)["stream_mixing"])
    assert 1.0 <= r <= n + 1e-6


def test_identity_layer_replaced_by_its_affine_fit_has_usefulness_one():
    m = model()
    make_identity(m, 3)
    r = usefulness_ratios(m, IDX)
    assert r[3].item() == pytest.approx(1.0, abs=1e-6)
    assert torch.isnan(r[0])
    assert all(r[l] != 1.0 for l in (1, 2, 4))


@pytest.mark.parametrize("arch", ["hc", "attnres_full", "attnres_block", "moda"])
def test_usefulness_is_defined_for_every_architecture(arch):
    m = model(arch, n_layer=2)  # hc at init: its n streams are identical, the fit rank-deficient
    r = usefulness_ratios(m, IDX)
    assert torch.isfinite(r[1:]).all()
    torch.testing.assert_close(
        usefulness_ratios(m, IDX), r, rtol=0, atol=0, equal_nan=True
    )  # one solution, every call


def test_prefix_average_part_is_removed_and_restored():
    from depthbench.probes.interventions import without_prefix_average

    m = model("post_ln", n_layer=2)
    base = residual_stream(m, IDX)
    # with all keys equal, attention is exactly the prefix average: the rest is zero
    with torch.no_grad():
        for b in m.blocks:
            q, k, v = b.attn.wqkv.weight.split(32)
            k.zero_()
    with without_prefix_average(m):
        x = torch.randn(2, 7, 32)
        assert torch.allclose(m.blocks[0].attn(x, m.rope(7)), torch.zeros(2, 7, 32), atol=1e-6)
    # hooks gone: the standard forward again
    x = torch.randn(2, 7, 32)
    assert not torch.allclose(m.blocks[0].attn(x, m.rope(7)), torch.zeros(2, 7, 32))
    assert len(base) == 3


def test_share_above_threshold_counts_pairs_in_the_last_three_quarters():
    from depthbench.probes.core import share_above

    C = torch.full((9, 9), float("nan"))
    for s in range(1, 9):
        C[s, s + 1 :] = 0.0
    C[1, 8] = 1.0  # layer 1 is in the first quarter: not counted
    C[3, 5] = 1.0
    C[6, 8] = 1.0
    pairs = sum(1 for s in range(3, 9) for l in range(s + 1, 9))
    assert share_above(C, 0.45) == pytest.approx(2 / pairs)


def test_attnres_block_dead_zone_uses_every_layers_partial_sum_weight():
    def dead_zone(depth, n_layer, n_blocks, threshold):
        arch = build_model(
            ModelConfig(
                arch="attnres_block",
                vocab_size=50,
                d_model=32,
                n_layer=n_layer,
                n_head=4,
                max_seq_len=16,
                arch_options={"n_blocks": n_blocks},
            )
        )
        return arch.dead_zone(depth, threshold)

    # 4 layers, 2 blocks (ends after layers 2 and 4); each sublayer's last weight is the one on
    # the partial sum; block starts (layers 1 and 3) have no partial sum at their attention
    def w(*values):
        return torch.tensor(values)

    depth = [
        w(1.0),
        w(0.99, 0.01),  # layer 1: attn (block start), ffn
        w(0.98, 0.02),
        w(0.97, 0.03),  # layer 2
        w(0.5, 0.5),
        w(0.4, 0.3, 0.3),  # layer 3: attn (block start), ffn
        w(0.2, 0.4, 0.4),
        w(0.1, 0.1, 0.8),
    ]
    length, weights = dead_zone(depth, 4, 2, threshold=0.05)
    assert weights == pytest.approx([0.01, 0.025, 0.3, 0.6])
    assert length == 2
    # every layer its own block: still defined for every layer, from the FFN sublayer
    depth = [w(1.0), w(0.5, 0.5), w(0.5, 0.5), w(0.9, 0.06, 0.04)]
    length, weights = dead_zone(depth, 2, 8, threshold=0.05)
    assert weights == pytest.approx([0.5, 0.04]) and length == 0


ALL_ARCHS = list(PACKAGE_ARCHITECTURES)  # every architecture of the package


@pytest.mark.parametrize(
    "arch, options",
    [(a, {}) for a in ALL_ARCHS]
    + [("moda", {"variant": "ffn_kv"}), ("attnres_block", {"n_blocks": 2})],
)
def test_permutation_scores_are_the_same_with_two_workers(arch, options):
    torch.manual_seed(0)
    m = build_model(
        ModelConfig(
            arch=arch,
            vocab_size=128,
            d_model=32,
            n_layer=4,
            n_head=2,
            max_seq_len=32,
            arch_options=options,
        )
    ).eval()
    for p in m.parameters():  # break zero-initialised dynamics and queries so that order matters
        p.data.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 128, (3, 17))
    base = lm_loss(m, idx)
    P = permutation_scores(m, idx)
    assert (P.nan_to_num(0.0) > 0).any()
    # shared among two workers (forked processes on Linux, each with its own copy of the model)
    torch.testing.assert_close(permutation_scores(m, idx, workers=2), P, equal_nan=True)
    assert lm_loss(m, idx) == base  # every swap restored


linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="forked workers are used on Linux only"
)


@pytest.mark.parametrize("mapper", [pytest.param("processes", marks=linux_only), "threads"])
def test_map_over_model_copies_returns_results_in_item_order(mapper):
    """Both worker kinds return fn's results in item order; forked workers mutate only their own
    copy, so a worker that zeroes its model's weights leaves the caller's model as it was."""
    m0 = model(n_layer=2)
    before = {k: v.clone() for k, v in m0.state_dict().items()}

    def fn(m, item):
        with torch.no_grad():
            next(m.parameters()).zero_()
        return torch.tensor([item, item * item])

    run = workers._map_in_forked_processes if mapper == "processes" else workers._map_in_threads
    out = run(m0, list(range(9)), fn, 2)
    assert [t.tolist() for t in out] == [[i, i * i] for i in range(9)]
    if mapper == "processes":
        for k, v in m0.state_dict().items():
            assert torch.equal(v, before[k]), k


@linux_only
def test_forked_worker_failures_name_the_item():
    def fn(m, item):
        if item == 3:
            raise ValueError("bad item three")
        return item

    with pytest.raises(RuntimeError, match=r"failed on item 3(.|\n)*ValueError: bad item three"):
        workers.map_over_model_copies(model(n_layer=2), list(range(6)), fn, workers=2)

    def dies(m, item):
        os._exit(7)

    with pytest.raises(RuntimeError, match="exited with code 7"):
        workers.map_over_model_copies(model(n_layer=2), list(range(6)), dies, workers=2)


def test_probe_workers_inside_a_daemonic_process_fall_back_to_threads(monkeypatch):
    """A multiprocessing pool's worker may not start children: the map uses threads there."""
    monkeypatch.setattr(multiprocessing.current_process(), "daemon", True, raising=False)
    monkeypatch.setattr(
        workers, "_map_in_forked_processes", lambda *a: pytest.fail("forked inside a daemon")
    )
    assert workers.map_over_model_copies(
        model(n_layer=2), [1, 2, 3], lambda m, i: i * 10, workers=2
    ) == [10, 20, 30]
