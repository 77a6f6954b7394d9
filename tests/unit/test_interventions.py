"""Skip, swap and replace mean the same thing for every architecture: each probe is compared, in
float64, with a computation that does not use the adapter's own mechanism:

- skip: a model of L - 1 layers built with the remaining layers' weights copied in, where the
  architecture declares no position-bound constants (`position_bound_constants`; pre_ln,
  post_ln, peri_ln, hc, mhc, moda, attnres_full); otherwise a forward written here that calls
  the other layers' blocks in order, for a trunk state that is one tensor (lns, deepnorm, keel
  keep their constants with their positions) or, for attnres_block, a from-scratch
  implementation of block attention residuals;
- swap: a model whose state dict has the two layers' entries exchanged, run by its own forward;
- replace: a forward written here in which the layer's place is taken by the affine map fitted
  (here, with numpy) from its input to its output.

The architectures come from the registry, so a new one is covered (or, with neither a copyable
layer nor a one-tensor state nor a reference here, fails until it gets one).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from depthbench.models.config import ModelConfig
from depthbench.models.registry import ARCHITECTURES, build_model, registered_architectures
from depthbench.models.archs.attnres_block import block_ends
from depthbench.models.archs.moda import depth_layout
from depthbench.models.archs.moda_depth_keys import DepthKeys
from depthbench.models.layers import apply_rotary
from depthbench.probes import core, interventions


def one_tensor_state(arch: str) -> bool:
    """Whether the trunk state between layers is one tensor, measured: what `begin` hands out."""
    cfg = ModelConfig(arch=arch, vocab_size=61, d_model=32, n_layer=2, n_head=4, max_seq_len=16)
    with torch.no_grad():
        return isinstance(
            build_model(cfg).begin(torch.zeros(1, 3, dtype=torch.long)).value, torch.Tensor
        )


ALL = registered_architectures()
TENSOR_STATE = [arch for arch in ALL if one_tensor_state(arch)]
# no constants of the layer's position or of L: a layer's weights may move to another depth
COPYABLE = [arch for arch in ALL if not ARCHITECTURES[arch].position_bound_constants]
L = 4
TOL = dict(rtol=1e-6, atol=1e-9)


def trained_like(arch: str, n_layer: int = L, seed: int = 0, **options) -> torch.nn.Module:
    """A float64 model whose zero-initialised parts (HC dynamics, mHC projections, AttnRes
    pseudo-queries) and unit gains are perturbed, as after training."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=61,
        d_model=32,
        n_layer=n_layer,
        n_head=4,
        max_seq_len=16,
        init_std=0.1,
        arch_options=options,
    )
    model = build_model(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


IDX = torch.randint(0, 61, (3, 11), generator=torch.Generator().manual_seed(1))


def hidden(model, idx) -> list[torch.Tensor]:
    with torch.no_grad():
        return model(idx, return_hidden=True).hidden


def causal_from(h: list[torch.Tensor], h_skipped: list[torch.Tensor], s: int) -> torch.Tensor:
    """C[s, l] for l > s from the baseline h_0..h_L and the skipped pass's h'_0..h'_(L-1)
    indexed as a model without layer s (h'_l at index l - 1 for l >= s)."""
    out = []
    for l in range(s + 1, len(h)):
        d, ds = h[l] - h[l - 1], h_skipped[l - 1] - h_skipped[l - 2]
        out.append((ds - d).norm(dim=-1).mean() / d.norm(dim=-1).mean())
    return torch.stack(out)


def without_layer(model, s: int):
    """The same architecture with L - 1 layers, layer s's weights left out, the others copied."""
    cfg = ModelConfig.from_dict({**model.cfg.to_dict(), "n_layer": model.cfg.n_layer - 1})
    smaller = build_model(cfg).double().eval()
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith("blocks."):
            index = int(key.split(".")[1]) + 1  # 1-based layer
            if index == s:
                continue
            rest = key.split(".", 2)[2]
            key = f"blocks.{index - 1 - (index > s)}.{rest}"
        state[key] = value
    smaller.load_state_dict(state)
    return smaller


def blocks_in_order(model, idx, skip=None, replace=None) -> list[torch.Tensor]:
    """h_0.. of a tensor-state model run block by block (skipped layers not called, a replaced
    layer's state given by `replace[layer](state)`)."""
    rope = model.rope(idx.shape[1])
    with torch.no_grad():
        state = model.init_state(model.embed_tokens(idx))
        out = [model.read_stream(state)]
        for l, block in enumerate(model.blocks, start=1):
            if l == skip:
                continue
            state = replace[l](state) if replace and l in replace else block(state, rope)
            out.append(model.read_stream(state))
    return out


def block_attnres_reference(model, idx, skip=None) -> list[torch.Tensor]:
    """Block Attention Residuals written out: the reads of the layers that run (h_(l-1) for each),
    then the final aggregation. Sources: v_0, completed block sums, and the partial sum once it
    holds anything; a skipped layer adds nothing."""
    cfg = model.cfg
    rope = model.rope(idx.shape[1])
    ends = set(block_ends(cfg.n_layer, model.options.n_blocks))

    def read(depth, candidates):
        units = [
            v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) for v in candidates
        ]
        w = torch.softmax(
            torch.stack([(u * depth.query * depth.key_norm.weight).sum(-1) for u in units]), dim=0
        )
        return sum(wi.unsqueeze(-1) * v for wi, v in zip(w, candidates))

    with torch.no_grad():
        sources, partial, reads = [model.embed(idx)], None, []
        for l, block in enumerate(model.blocks, start=1):
            if l != skip:
                for position, (depth, sub) in enumerate(
                    (
                        (block.attn_depth, lambda h: block.attn(block.attn_norm(h), rope)),
                        (block.ffn_depth, lambda h: block.ffn(block.ffn_norm(h))),
                    )
                ):
                    h = read(depth, sources + ([partial] if partial is not None else []))
                    if position == 0:
                        reads.append(h)
                    out = sub(h)
                    partial = out if partial is None else partial + out
            if l in ends and partial is not None:
                sources.append(partial)
                partial = None
        reads.append(read(model.final_depth, sources))
    return reads


def test_the_lists_are_what_the_eleven_architectures_declare():
    """The lists derived from the registry hold the package's architectures as they are."""
    norm_family = ["pre_ln", "post_ln", "peri_ln", "lns", "deepnorm", "keel"]
    eleven = norm_family + ["hc", "mhc", "attnres_full", "attnres_block", "moda"]
    assert set(eleven) <= set(ALL)
    assert {a for a in TENSOR_STATE if a in eleven} == {*norm_family, "hc", "mhc"}
    copyable = {"pre_ln", "post_ln", "peri_ln", "hc", "mhc", "moda", "attnres_full"}
    assert {a for a in COPYABLE if a in eleven} == copyable


@pytest.mark.parametrize("arch", ALL)
def test_skipping_a_layer_equals_the_model_without_it(arch):
    model = trained_like(arch, **({"n_blocks": 2} if arch == "attnres_block" else {}))
    C = interventions.causal_scores(model, IDX)
    h = hidden(model, IDX)
    assert torch.isnan(C[L]).all() and torch.isnan(C[:, 1]).all()
    for s in range(1, L):
        if arch in COPYABLE:
            reference = hidden(without_layer(model, s), IDX)
        elif arch in TENSOR_STATE:
            reference = blocks_in_order(model, IDX, skip=s)
        elif arch == "attnres_block":
            reference = block_attnres_reference(model, IDX, skip=s)
            torch.testing.assert_close(
                block_attnres_reference(model, IDX), h, **TOL
            )  # the reference is the model
        else:
            pytest.fail(f"{arch}: no independent computation of a skipped layer; write one here")
        torch.testing.assert_close(C[s, s + 1 :].double(), causal_from(h, reference, s), **TOL)
        assert torch.isnan(C[s, : s + 1]).all()


def test_a_skipped_block_start_layer_leaves_no_zero_source():
    """attnres_block with every layer its own block: skipping layer 2 must not leave a source."""
    model = trained_like("attnres_block", n_blocks=8)
    state = model.skip(model.step(model.begin(IDX), 1), 2)
    assert len(state.value.values) == 2  # v_0 and layer 1's block; nothing for layer 2


def test_a_skipped_moda_layer_leaves_no_depth_keys():
    model = trained_like("moda")
    state = model.skip(model.step(model.begin(IDX), 1), 2)
    assert len(state.value[1]) == 1
    torch.testing.assert_close(
        model.residual(state), model.residual(model.step(model.begin(IDX), 1)), rtol=0, atol=0
    )


def state_dict_swapped(model, a: int, b: int) -> dict:
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("blocks."):
            index = int(key.split(".")[1]) + 1
            other = {a: b, b: a}.get(index, index)
            key = f"blocks.{other - 1}.{key.split('.', 2)[2]}"
        out[key] = value
    return out


@pytest.mark.parametrize("arch", ALL)
def test_permutation_score_equals_the_model_with_exchanged_weights(arch):
    model = trained_like(arch, **({"n_blocks": 2} if arch == "attnres_block" else {}))
    P = interventions.permutation_scores(model, IDX)
    with torch.no_grad():
        base = float(model(IDX[:, :-1], IDX[:, 1:]).loss)
        for a, b in [(1, 2), (1, 4), (2, 3), (3, 4)]:
            other = build_model(model.cfg).double().eval()
            other.load_state_dict(state_dict_swapped(model, a, b))
            swapped = float(other(IDX[:, :-1], IDX[:, 1:]).loss)
            assert P[a, b].item() == pytest.approx(abs(swapped - base) / base, rel=1e-6, abs=1e-12)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    with model.swapped(1, 3):
        pass
    for k, v in model.state_dict().items():  # restored
        assert torch.equal(v, reference[k]), k


def numpy_affine_fit(x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """Minimum-norm least squares [x, 1] W ~ y with numpy (independent of the probe's solver)."""
    X = x.reshape(-1, x.shape[-1]).numpy()
    design = np.concatenate([X, np.ones((X.shape[0], 1))], axis=1)
    return np.linalg.lstsq(design, y.reshape(-1, y.shape[-1]).numpy(), rcond=None)[0]


def apply_numpy(x: torch.Tensor, W: np.ndarray) -> torch.Tensor:
    X = x.reshape(-1, x.shape[-1]).numpy()
    Y = np.concatenate([X, np.ones((X.shape[0], 1))], axis=1) @ W
    return torch.from_numpy(Y).reshape(*x.shape[:-1], W.shape[1])


def loss_of_final(model, state, targets) -> float:
    x = model.trunk_output(state)
    logits = model.lm_head(model.final_norm(x) if model.final_norm is not None else x)
    return float(
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    )


@pytest.mark.parametrize("arch", TENSOR_STATE)
def test_usefulness_equals_a_forward_with_the_layer_replaced_by_its_fit(arch):
    model = trained_like(arch)
    inputs, targets = IDX[:, :-1], IDX[:, 1:]
    r = interventions.usefulness_ratios(model, IDX)
    rope = model.rope(inputs.shape[1])
    with torch.no_grad():
        base = float(model(inputs, targets).loss)
        states = [model.init_state(model.embed_tokens(inputs))]
        for block in model.blocks:
            states.append(block(states[-1], rope))
        for l in range(1, L + 1):
            x, y = states[l - 1], states[l]
            W = numpy_affine_fit(x.reshape(*x.shape[:2], -1), y.reshape(*y.shape[:2], -1))
            state = states[l - 1]
            for layer, block in enumerate(model.blocks, start=1):
                if layer < l:
                    continue
                state = (
                    apply_numpy(state.reshape(*state.shape[:2], -1), W).reshape(state.shape)
                    if layer == l
                    else block(state, rope)
                )
            assert r[l].item() == pytest.approx(
                loss_of_final(model, state, targets) / base, rel=1e-6
            )


def test_attnres_usefulness_replaces_both_sources_by_functions_of_the_layer_input():
    """attnres_full, layer l replaced: its attention and FFN outputs are affine in what it reads
    first, h_(l-1); checked against the model's own forward with those two outputs substituted
    through forward hooks on the sublayers."""
    model = trained_like("attnres_full")
    inputs, targets = IDX[:, :-1], IDX[:, 1:]
    r = interventions.usefulness_ratios(model, IDX)
    with torch.no_grad():
        base = float(model(inputs, targets).loss)
        for l in range(1, L + 1):
            block, captured = model.blocks[l - 1], {}
            hooks = [
                block.attn_norm.register_forward_pre_hook(
                    lambda m, args: captured.setdefault("h", args[0])
                ),
                block.attn.register_forward_hook(
                    lambda m, a, out: captured.setdefault("attn", out)
                ),
                block.ffn.register_forward_hook(lambda m, a, out: captured.setdefault("ffn", out)),
            ]
            model(inputs)
            for hook in hooks:
                hook.remove()
            W = numpy_affine_fit(
                captured["h"], torch.cat([captured["attn"], captured["ffn"]], dim=-1)
            )
            fitted = apply_numpy(captured["h"], W)
            hooks = [
                block.attn.register_forward_hook(lambda m, a, out: fitted[..., :32]),
                block.ffn.register_forward_hook(lambda m, a, out: fitted[..., 32:]),
            ]
            replaced = float(model(inputs, targets).loss)
            for hook in hooks:
                hook.remove()
            assert r[l].item() == pytest.approx(replaced / base, rel=1e-6)


@pytest.mark.parametrize("variant", ["reuse_kv", "ffn_kv"])
def test_moda_usefulness_replaces_the_depth_keys_too(variant):
    """moda, layer l replaced: its stream output and the (pre-RoPE) depth keys and values it
    leaves are affine in its input, RoPE re-applied; checked against a forward written here."""
    model = trained_like("moda", variant=variant)
    inputs, targets = IDX[:, :-1], IDX[:, 1:]
    r = interventions.usefulness_ratios(model, IDX)
    rope = model.rope(inputs.shape[1])
    cos, sin = rope
    with torch.no_grad():
        base = float(model(inputs, targets).loss)
        for l in range(1, L + 1):
            x, depth = model.embed_tokens(inputs), DepthKeys()
            for layer, block in enumerate(model.blocks, start=1):
                if layer == l:
                    before = len(depth)
                    out = block(x, rope, None, depth)
                    left = depth.pairs[before:]
                    del depth.pairs[before:]
                    unrotated = [
                        t.transpose(1, 2).reshape(*x.shape[:2], -1)
                        for k, v in left
                        for t in (apply_rotary(k, cos, -sin), v)
                    ]
                    W = numpy_affine_fit(x, torch.cat([out, *unrotated], dim=-1))
                    y = apply_numpy(x, W)
                    a = block.attn
                    for i in range(len(left)):
                        k, v = (
                            y[..., 32 + (2 * i + j) * a.kv_dim : 32 + (2 * i + j + 1) * a.kv_dim]
                            .reshape(*x.shape[:2], a.n_kv_head, a.head_dim)
                            .transpose(1, 2)
                            for j in (0, 1)
                        )
                        depth.append((depth_layout(apply_rotary(k, cos, sin)), depth_layout(v)))
                    x = y[..., :32]
                else:
                    x = block(x, rope, None, depth)
            logits = model.lm_head(model.final_norm(x))
            replaced = float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
                )
            )
            assert r[l].item() == pytest.approx(replaced / base, rel=1e-6)


@pytest.mark.parametrize("arch", ALL)
def test_replacing_a_layer_by_its_own_outputs_changes_nothing(arch):
    model = trained_like(arch)
    inputs = IDX[:, :-1]
    with torch.no_grad():
        states = [model.begin(inputs)]
        for layer in range(1, L + 1):
            x, y, after = model.layer_io(states[-1], layer)
            replaced = model.replace(states[-1], layer, y)
            torch.testing.assert_close(
                model.residual(replaced), model.residual(after), rtol=0, atol=0
            )
            states.append(after)
        torch.testing.assert_close(model.logits(states[-1]), model(inputs).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ALL)
def test_states_are_values(arch):
    """step, skip and replace never change the state they are given: a state saved by the
    baseline pass can seed any number of changed passes."""
    model = trained_like(arch)
    with torch.no_grad():
        state = model.step(model.begin(IDX), 1)
        h1 = model.residual(state)
        for _ in range(2):
            model.step(state, 2)
            model.skip(state, 2)
            model.replace(state, 2, model.layer_io(state, 2)[1])
            torch.testing.assert_close(model.residual(state), h1, rtol=0, atol=0)
            assert core.lm_loss(model, IDX) == pytest.approx(
                float(model(IDX[:, :-1], IDX[:, 1:]).loss), rel=1e-12
            )
