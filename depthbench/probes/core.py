"""Probe computations on a model and a fixed batch of token sequences.

Conventions: `idx` is a (N, T) LongTensor of validation sequences; h_l is what layer l + 1 reads
(`DecoderLM.forward(return_hidden=True)`); layers are numbered 1..L.
"""

from __future__ import annotations

import copy
import math
import multiprocessing
import multiprocessing.connection
import pickle
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Callable

import torch

from depthbench.models.base import DecoderLM


@torch.no_grad()
def residual_stream(model: DecoderLM, idx: torch.Tensor) -> list[torch.Tensor]:
    """h_0..h_L, each (N, T, d), in fp32."""
    model.eval()
    return [h.float() for h in model(idx, return_hidden=True).hidden]


@torch.no_grad()
def lm_loss(model: DecoderLM, idx: torch.Tensor) -> float:
    """Mean next-token cross-entropy of the sample (targets are the inputs shifted by one)."""
    model.eval()
    return float(model(idx[:, :-1], idx[:, 1:]).loss)


# -- angular distance (Gromov et al. 2024) ---------------------------------------------------------
def angular_distance(hidden: list[torch.Tensor], last_token_only: bool = True) -> torch.Tensor:
    """D[l, k] = arccos(cos(h_l, h_{l+k})) / pi averaged over sequences (last token) or over all
    tokens; NaN where l + k > L. Shape (L + 1, L + 1), k = 0..L."""
    H = torch.stack(hidden)  # (L+1, N, T, d)
    if last_token_only:
        H = H[:, :, -1:]
    H = torch.nn.functional.normalize(H, dim=-1)
    L1 = H.shape[0]
    out = torch.full((L1, L1), float("nan"))
    for l in range(L1):
        cos = (H[l : l + 1] * H[l:]).sum(-1).clamp(-1.0, 1.0)  # (L1 - l, N, T)
        out[l, : L1 - l] = (torch.arccos(cos) / math.pi).mean(dim=(1, 2))
    return out


# -- skipping a layer: its sublayers add nothing ---------------------------------------------------
@contextmanager
def skip_layers(model: DecoderLM, layers: list[int]):
    """Within the context, the attention and FFN sublayers of the given 1-based layers output
    zeros, whatever residual rule surrounds them (for pre_ln the layer becomes the identity)."""
    handles = []
    for l in layers:
        block = model.blocks[l - 1]
        for sub in (block.attn, block.ffn):
            handles.append(sub.register_forward_hook(lambda module, args, out: torch.zeros_like(out)))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def _delta_norms(hidden: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(hidden[l] - hidden[l - 1]) for l in range(1, len(hidden))])  # (L, N, T, d)


@torch.no_grad()
def causal_scores(model: DecoderLM, idx: torch.Tensor, workers: int = 1) -> torch.Tensor:
    """C[s, l] = E||(h'_l - h'_{l-1}) - (h_l - h_{l-1})|| / E||h_l - h_{l-1}||, h' with layer s
    skipped, for l > s (NaN elsewhere); 1-based (L + 1, L + 1) with row/column 0 unused.
    One baseline pass, then one pass per skipped layer s, which resumes at layer s from the
    state entering it (skipping s leaves layers 1 .. s-1 as they were): L + 1 passes at most,
    and about half of that in layer evaluations. The passes are shared among `workers` (see
    map_over_model_copies)."""
    base = _delta_norms(residual_stream(model, idx))
    L = base.shape[0]
    denom = base.norm(dim=-1).mean(dim=(1, 2))  # (L,)
    states = layer_states(model, idx)
    C = torch.full((L + 1, L + 1), float("nan"))

    def skipped_diff(m: DecoderLM, s: int) -> torch.Tensor:
        with skip_layers(m, [s]):
            resumed = _delta_norms(hidden_from_layer(m, s, states[s - 1], idx.shape[1]))  # layers s..L
        return (resumed[1:] - base[s:]).norm(dim=-1).mean(dim=(1, 2))  # layers s+1..L

    for s, diff in enumerate(map_over_model_copies(model, list(range(1, L + 1)), skipped_diff, workers), start=1):
        C[s, s + 1 :] = diff / denom[s:]
    return C


@torch.no_grad()
def causal_scores_naive(model: DecoderLM, idx: torch.Tensor) -> torch.Tensor:
    """The same matrix with a fresh pair of passes for every (s, l): the reference for tests."""
    L = model.cfg.n_layer
    C = torch.full((L + 1, L + 1), float("nan"))
    for s in range(1, L + 1):
        for l in range(s + 1, L + 1):
            h = residual_stream(model, idx)
            with skip_layers(model, [s]):
                hs = residual_stream(model, idx)
            d, ds = h[l] - h[l - 1], hs[l] - hs[l - 1]
            C[s, l] = (ds - d).norm(dim=-1).mean() / d.norm(dim=-1).mean()
    return C


# -- permutation score ------------------------------------------------------------------------------
@contextmanager
def swapped_layers(model: DecoderLM, a: int, b: int):
    """Exchange every parameter of layers a and b (1-based); restored on exit. Constants bound to
    the position (LNS's 1/sqrt(l), DeepNorm's alpha) are attributes, not parameters: they stay."""
    pa = dict(model.blocks[a - 1].named_parameters())
    pb = dict(model.blocks[b - 1].named_parameters())
    with torch.no_grad():
        for name in pa:
            tmp = pa[name].detach().clone()
            pa[name].copy_(pb[name])
            pb[name].copy_(tmp)
    try:
        yield model
    finally:
        with torch.no_grad():
            for name in pa:
                tmp = pa[name].detach().clone()
                pa[name].copy_(pb[name])
                pb[name].copy_(tmp)


@torch.no_grad()
def layer_states(model: DecoderLM, inputs: torch.Tensor) -> list:
    """The trunk state entering each layer (index l - 1 for layer l) in one forward pass, each
    forked so that a later pass resumed from it leaves it unchanged (DecoderLM.layer_step)."""
    rope = model.rope(inputs.shape[1])
    state = model.init_state(model.embed_tokens(inputs))
    states = []
    for block in model.blocks:
        states.append(model.fork_state(state))
        state = model.layer_step(state, block, rope)
    return states


@torch.no_grad()
def hidden_from_layer(model: DecoderLM, layer: int, state, seq_len: int) -> list[torch.Tensor]:
    """h_(layer-1) .. h_L in fp32 of a pass resumed at block `layer` (1-based) from the state
    entering it (left unchanged): the tail of `residual_stream` from there on."""
    hidden = model.hidden_from_layer(model.fork_state(state), layer, model.rope(seq_len))
    return [h.float() for h in hidden]


@torch.no_grad()
def loss_from_layer(model: DecoderLM, layer: int, state, targets: torch.Tensor) -> float:
    """The LM loss of a forward pass resumed at block `layer` (1-based) from the state entering
    it: the same operations as DecoderLM.forward from there on."""
    rope = model.rope(targets.shape[1])
    state = model.fork_state(state)
    for block in model.blocks[layer - 1 :]:
        state = model.layer_step(state, block, rope)
    x = model.trunk_output(state)
    if model.final_norm is not None:
        x = model.final_norm(x)
    logits = model.lm_head(x)
    return float(torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1)))


def map_over_model_copies(model: DecoderLM, items: list, fn: Callable, workers: int = 1) -> list:
    """[fn(m, item) for item in items], where m is `model` or a private copy of it: probes swap
    weights and attach hooks in place, so each worker holds its own copy.

    With workers > 1 (CPU only) the items are shared among that many workers, each running
    torch with one intra-op thread. At probe shapes (d = 32, 2 048 tokens) the kernels are
    small, so one stream of them is bound by Python and dispatch overhead rather than by
    arithmetic, and two single-threaded streams do more work than one two-threaded stream. On
    Linux the workers are forked processes (the copy is the fork's copy-on-write image, and no
    GIL is shared). Elsewhere, where forking a process that has loaded torch is not safe, and
    inside a daemonic process, which may not start children, they are threads with deep copies
    (the GIL is released inside kernels but serialises the Python between them). Items are
    taken in the given order from a shared counter (put the longest first); results come back
    in item order."""
    workers = max(1, min(workers, len(items)))
    if workers == 1 or next(model.parameters()).device.type != "cpu":
        return [fn(model, item) for item in items]
    # a daemonic process (a multiprocessing pool's worker, say) may not start children
    if sys.platform.startswith("linux") and not multiprocessing.current_process().daemon:
        return _map_in_forked_processes(model, items, fn, workers)
    return _map_in_threads(model, items, fn, workers)


def _map_in_threads(model: DecoderLM, items: list, fn: Callable, workers: int) -> list:
    results: list = [None] * len(items)
    queue = iter(enumerate(items))
    lock, errors = threading.Lock(), []

    def work(m: DecoderLM) -> None:
        while not errors:
            with lock:
                nxt = next(queue, None)
            if nxt is None:
                return
            try:
                results[nxt[0]] = fn(m, nxt[1])
            except BaseException as exc:  # re-raised in the calling thread
                errors.append(exc)

    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        threads = [threading.Thread(target=work, args=(model if i == 0 else copy.deepcopy(model),)) for i in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(intra_op)
    if errors:
        raise errors[0]
    return results


def _forked_worker(model: DecoderLM, items: list, fn: Callable, counter, conn) -> None:
    """Runs in a forked child: take the next item index from the shared counter until none is
    left; send (index, result) pickled with plain pickle (torch's multiprocessing reductions
    would pass tensors as shared-memory handles that must outlive this process)."""
    torch.set_num_threads(1)
    i = -1
    try:
        while True:
            with counter.get_lock():
                i = counter.value
                counter.value += 1
            if i >= len(items):
                break
            conn.send_bytes(pickle.dumps(("ok", i, fn(model, items[i]))))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", i, traceback.format_exc())))
    finally:
        conn.send_bytes(pickle.dumps(("done", -1, None)))
        conn.close()


def _map_in_forked_processes(model: DecoderLM, items: list, fn: Callable, workers: int) -> list:
    ctx = multiprocessing.get_context("fork")
    counter = ctx.Value("q", 0)
    procs, readers = [], {}
    for _ in range(workers):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_forked_worker, args=(model, items, fn, counter, writer), daemon=True)
        proc.start()
        writer.close()  # the child holds the only write end: EOF here means it is gone
        procs.append(proc)
        readers[reader] = proc
    results: list = [None] * len(items)
    received = [False] * len(items)
    failure = None
    try:
        while readers and failure is None:
            for reader in multiprocessing.connection.wait(list(readers)):
                try:
                    kind, i, payload = pickle.loads(reader.recv_bytes())
                except EOFError:
                    proc = readers.pop(reader)
                    proc.join()
                    failure = failure or f"a probe worker process exited with code {proc.exitcode} before finishing"
                    continue
                if kind == "ok":
                    results[i], received[i] = payload, True
                elif kind == "error":
                    failure = f"a probe worker failed on item {items[i]!r}:\n{payload}"
                else:  # done
                    readers.pop(reader).join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
    if failure is None and not all(received):
        failure = f"probe workers returned {sum(received)} of {len(items)} results"
    if failure is not None:
        raise RuntimeError(failure)
    return results


@torch.no_grad()
def permutation_scores(model: DecoderLM, idx: torch.Tensor, workers: int = 1) -> torch.Tensor:
    """P[a, b] = |loss_swapped - loss| / loss for a < b (1-based, NaN elsewhere): weights swapped
    in place and restored. Swapping a and b leaves layers 1 .. a-1 unchanged, so the trunk
    state entering every layer is computed once and each swapped pass resumes at layer a (a
    third fewer layer evaluations over all pairs, same numbers). `workers`: see
    map_over_model_copies."""
    model.eval()
    L = model.cfg.n_layer
    base = lm_loss(model, idx)
    states = layer_states(model, idx[:, :-1])
    targets = idx[:, 1:]
    pairs = [(a, b) for a in range(1, L + 1) for b in range(a + 1, L + 1)]  # longest passes first

    def swapped_loss(m: DecoderLM, pair: tuple[int, int]) -> float:
        with swapped_layers(m, *pair):
            return loss_from_layer(m, pair[0], states[pair[0] - 1], targets)

    P = torch.full((L + 1, L + 1), float("nan"))
    for (a, b), loss in zip(pairs, map_over_model_copies(model, pairs, swapped_loss, workers)):
        P[a, b] = abs(loss - base) / base
    return P


# -- token similarity and effective rank ------------------------------------------------------------
def token_similarity(h: torch.Tensor, skip_first: bool = False) -> float:
    """Mean over token pairs i < j of cos(h[i], h[j]) within a sequence, averaged over sequences."""
    if skip_first:
        h = h[:, 1:]
    x = torch.nn.functional.normalize(h.float(), dim=-1)
    T = x.shape[1]
    gram = x @ x.transpose(1, 2)  # (N, T, T)
    upper = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    return float(gram[:, upper].mean())


def effective_rank(matrix: torch.Tensor) -> float:
    """Roy and Vetterli: p_i = sigma_i / sum sigma, erank = exp(-sum p_i log p_i)."""
    s = torch.linalg.svdvals(matrix.double())
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def residual_product_rank(stream_mixing: list[torch.Tensor]) -> float:
    """erank of the product M_2L ... M_1 of the per-sublayer stream-mixing matrices (each acting
    as H <- M H: A_r^T for hc, H_res for mhc), per token, averaged over tokens; in [1, n]."""
    product = None
    for M in stream_mixing:  # (N, T, n, n), applied in order
        M = M.detach()
        product = M if product is None else M @ product
    flat = product.reshape(-1, *product.shape[-2:]).double()
    s = torch.linalg.svdvals(flat)
    p = s / s.sum(-1, keepdim=True)
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    return float(ent.exp().mean())



# -- usefulness score ------------------------------------------------------------------------------
STATE_ARCHS_NOTE = (
    "usefulness replaces a layer's map from its input state to its output state; attnres layers "
    "read an aggregate of all earlier outputs, so the probe is not defined for them"
)


@torch.no_grad()
def block_io(model: DecoderLM, idx: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input state, output state) of every layer on the sample, flattened to (N*T, width)."""
    records: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [
        b.register_forward_hook(lambda m, args, out: records.append((args[0].detach(), out.detach())))
        for b in model.blocks
    ]
    try:
        model.eval()
        model(idx[:, :-1])
    finally:
        for h in handles:
            h.remove()
    return [(x.reshape(-1, x[0, 0].numel()).double(), y.reshape(-1, y[0, 0].numel()).double()) for x, y in records]


def affine_fit(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The least-squares affine map [x, 1] @ W ~ y, (width + 1, width): the minimum-norm
    solution (SVD driver), so that it is unique when the inputs are rank-deficient, as HC's and
    mHC's streams are at initialisation (n identical copies). The default QR driver returns one
    of many solutions there, a different one from call to call, and the probe's loss moved with
    it (0.3% on a 3-layer hc model). Solved on the CPU, the only device with that driver."""
    design = torch.cat([x, torch.ones_like(x[:, :1])], dim=1).cpu()
    return torch.linalg.lstsq(design, y.cpu(), driver="gelsd").solution.to(x.device)


@contextmanager
def affine_layer(model: DecoderLM, layer: int, weight: torch.Tensor):
    """Layer `layer` (1-based) replaced by state -> [state, 1] @ weight."""

    def hook(module, args, out):
        x = args[0]
        flat = x.reshape(*x.shape[:2], -1).double()
        y = torch.cat([flat, torch.ones_like(flat[..., :1])], dim=-1) @ weight
        return y.to(out.dtype).reshape(out.shape)

    handle = model.blocks[layer - 1].register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@torch.no_grad()
def usefulness_ratios(model: DecoderLM, idx: torch.Tensor, workers: int = 1) -> torch.Tensor:
    """r_l = loss with layer l replaced by its least-squares affine fit / loss (1-based, index 0
    unused). One pass records every layer's input and output; each fit is solved once, and its
    pass resumes at layer l from the state entering it."""
    if model.arch_name.startswith("attnres"):
        raise ValueError(STATE_ARCHS_NOTE)
    base = lm_loss(model, idx)
    states, targets = layer_states(model, idx[:, :-1]), idx[:, 1:]
    ratios = torch.full((model.cfg.n_layer + 1,), float("nan"))

    def affine_ratio(m: DecoderLM, layer_io: tuple[int, tuple[torch.Tensor, torch.Tensor]]) -> float:
        l, (x, y) = layer_io
        with affine_layer(m, l, affine_fit(x, y)):  # layers 1 .. l-1 are unchanged: resume at layer l
            return loss_from_layer(m, l, states[l - 1], targets) / base

    layers = list(enumerate(block_io(model, idx), start=1))
    for (l, _), ratio in zip(layers, map_over_model_copies(model, layers, affine_ratio, workers)):
        ratios[l] = ratio
    return ratios


# -- prefix-average intervention (rank-collapse diagnostic) --------------------------------------
@contextmanager
def without_prefix_average(model: DecoderLM):
    """Every causal attention matrix P is split into its prefix-average part U (row t uniform over
    positions <= t) and the rest; within the context attention outputs (P - U) V only. Applies to
    architectures whose attention sublayer is the standard CausalSelfAttention call (not moda)."""
    if model.arch_name == "moda":
        raise ValueError("the prefix-average intervention needs the standard attention sublayer; moda's is joint over depth")
    patched = []

    def make_forward(attn):
        def forward(x, rope):
            B, T, _ = x.shape
            q, k, v = attn.project_qkv(x, rope)
            groups = attn.n_head // attn.n_kv_head
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(attn.head_dim)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            P = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            U = causal.to(P.dtype) / torch.arange(1, T + 1, device=x.device, dtype=P.dtype).unsqueeze(1)
            y = (P - U) @ v
            return attn.wo(y.transpose(1, 2).reshape(B, T, attn.q_dim))

        return forward

    for block in model.blocks:
        block.attn.forward = make_forward(block.attn)
        patched.append(block.attn)
    try:
        yield model
    finally:
        for attn in patched:
            del attn.forward


def token_similarity_by_layer(hidden: list[torch.Tensor], skip_first: bool = False) -> list[float]:
    return [token_similarity(h, skip_first) for h in hidden]


def effective_rank_by_layer(hidden: list[torch.Tensor]) -> list[float]:
    """erank of each sequence's (T, d) token matrix at every layer, averaged over sequences."""
    return [sum(effective_rank(seq) for seq in h) / h.shape[0] for h in hidden]


def last_quarters(L: int) -> range:
    """Layers in the last three quarters of depth: l > L/4 (1-based)."""
    return range(L // 4 + 1, L + 1)


def share_above(matrix: torch.Tensor, threshold: float) -> float:
    """Fraction of defined pairs with both layers in the last 3/4 of depth whose score exceeds
    `threshold` (the summaries of the causal and permutation probes)."""
    L = matrix.shape[0] - 1
    layers = list(last_quarters(L))
    values = matrix[layers][:, layers]
    values = values[~torch.isnan(values)]
    return float((values > threshold).float().mean()) if values.numel() else float("nan")
