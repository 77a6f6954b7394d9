"""Layer removal: which layers can go, chosen by five rankings, and what the loss does.

Removing a set R of layers is one pass in which every layer of R is skipped (`adapter.skip`: the
state passes unchanged and nothing of the layer reaches later layers; for AttnRes a removed layer
is no longer a source of the depth softmax, for HC/mHC all of the layer's stream update goes,
for MoDA its depth keys and values are not written), resumed at the first removed layer from the
baseline pass's state (layers before it are unchanged by the removal).

The rankings, each giving the k layers to remove for k = 1 .. L - 1, all computed on the probe
sample (hidden states h_0 .. h_L and the causal score matrix), never on the data the loss is
measured on:

- `angular_block` (Gromov et al. 2024): the contiguous block of layers l + 1 .. l + k whose input
  h_l and output h_{l+k} are closest in last-token angular distance d(h_l, h_{l+k}) =
  arccos(cos) / pi, with l + k <= L - 1 so that the final layer is kept;
- `block_influence` (ShortGPT): BI_l = 1 - mean over tokens of cos(h_{l-1}, h_l), the k lowest;
- `causal`: the k layers whose removal changes later layers least, by the mean over l > s of the
  causal score C(s, l); the last layer has no later layer to judge it by and is kept;
- `last`: the k layers just before the final one, L - k .. L - 1;
- `random`: a seeded uniform draw of k of the L layers, `RANDOM_DRAWS` draws per k (the
  baseline every ranking must beat).

Effective depth, from these curves: depthbench.probes.effective_depth.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from depthbench.models.adapter import ModelAdapter, trunk_states

RANKINGS = ("angular_block", "block_influence", "causal", "last", "random")
RANDOM_DRAWS = 3


@dataclass(frozen=True)
class ScoredTokens:
    """Inputs (N, T), their next tokens (N, T) and which positions are scored (N, T): the
    validation windows score every position, the NLL documents only their continuations."""

    inputs: torch.Tensor
    targets: torch.Tensor
    scored: torch.Tensor

    @classmethod
    def windows(cls, idx: torch.Tensor) -> "ScoredTokens":
        """Every position of token windows (N, T + 1) scored."""
        return cls(idx[:, :-1], idx[:, 1:], torch.ones_like(idx[:, 1:], dtype=torch.bool))

    @classmethod
    def documents(cls, docs: pd.DataFrame, window: int) -> "ScoredTokens":
        """The continuations of tokenized NLL documents (columns context_ids, continuation_ids),
        split into windows of at most `window` inputs as the NLL stage scores them, right-padded
        (causal attention keeps the padding out of every scored position)."""
        from depthbench.evals.nll import rolling_windows

        wins = [
            w
            for ctx, cont in zip(docs["context_ids"], docs["continuation_ids"])
            for w in rolling_windows(list(ctx), list(cont), window)
        ]
        T = max(len(w.inputs) for w in wins)
        inputs = torch.zeros(len(wins), T, dtype=torch.long)
        targets = torch.zeros(len(wins), T, dtype=torch.long)
        scored = torch.zeros(len(wins), T, dtype=torch.bool)
        for row, w in enumerate(wins):
            n_in, n_t = len(w.inputs), len(w.targets)
            inputs[row, :n_in] = torch.tensor(w.inputs)
            targets[row, n_in - n_t : n_in] = torch.tensor(w.targets)
            scored[row, n_in - n_t : n_in] = True
        return cls(inputs, targets, scored)

    def to(self, device) -> "ScoredTokens":
        return ScoredTokens(*(t.to(device) for t in (self.inputs, self.targets, self.scored)))

    def loss(self, logits: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (fp32) over the scored positions, a 0-dim tensor on the logits'
        device (read by the caller, once for all removal sets)."""
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), self.targets.reshape(-1), reduction="none"
        )
        return nll[self.scored.reshape(-1)].mean()


def block_influence(hidden: list[torch.Tensor]) -> torch.Tensor:
    """BI_l for l = 1 .. L (index l - 1): 1 - mean over all tokens of cos(h_{l-1}, h_l)."""
    return torch.stack(
        [
            1
            - torch.nn.functional.cosine_similarity(
                hidden[l - 1].double(), hidden[l].double(), dim=-1
            ).mean()
            for l in range(1, len(hidden))
        ]
    )


def angular_block(distance_last: torch.Tensor, n_layer: int, k: int) -> list[int]:
    """Layers l + 1 .. l + k for the l that minimises D[l, k] = d(h_l, h_{l+k}) at the last token
    (core.angular_distance's (L + 1, L + 1) matrix), l + k <= L - 1; the first such l on ties."""
    starts = range(0, n_layer - k)
    best = min(starts, key=lambda l: (float(distance_last[l, k]), l))
    return list(range(best + 1, best + k + 1))


def causal_order(causal: torch.Tensor, n_layer: int) -> list[int]:
    """Layers 1 .. L - 1 by the mean causal score of their removal on later layers, lowest first."""
    influence = {s: float(np.nanmean(causal[s, s + 1 :].numpy())) for s in range(1, n_layer)}
    return sorted(influence, key=lambda s: (influence[s], s))


def removal_sets(
    influence: torch.Tensor,
    distance_last: torch.Tensor,
    causal: torch.Tensor,
    n_layer: int,
    ks: Iterable[int],
    seed: int,
) -> list[tuple[str, int, int, list[int]]]:
    """(ranking, draw, k, layers removed) for every ranking and k; draw is 0 except for `random`.
    `influence`: BI_l for l = 1 .. L; `distance_last`, `causal`: the (L + 1, L + 1) matrices."""
    L = n_layer
    by_bi = sorted(range(1, L + 1), key=lambda l: (float(influence[l - 1]), l))
    by_causal = causal_order(causal, L)
    rng = np.random.default_rng(seed)
    out = []
    for k in ks:
        if not 1 <= k <= L - 1:
            raise ValueError(f"cannot remove {k} of {L} layers: k must be in 1 .. {L - 1}")
        out.append(("angular_block", 0, k, angular_block(distance_last, L, k)))
        out.append(("block_influence", 0, k, sorted(by_bi[:k])))
        out.append(("causal", 0, k, sorted(by_causal[:k])))
        out.append(("last", 0, k, list(range(L - k, L))))
        for draw in range(RANDOM_DRAWS):
            out.append(
                (
                    "random",
                    draw,
                    k,
                    sorted(int(x) for x in rng.choice(np.arange(1, L + 1), size=k, replace=False)),
                )
            )
    return out


def layer_counts(n_layer: int, fractions: list[float] | None) -> list[int]:
    """k = 1 .. L - 1, or the distinct k = round(f L) in 1 .. L - 1 of the configured fractions."""
    if not fractions:
        return list(range(1, n_layer))
    return sorted({min(n_layer - 1, max(1, round(f * n_layer))) for f in fractions})


@torch.no_grad()
def loss_without(
    adapter: ModelAdapter, states: list, data: ScoredTokens, removed: list[int]
) -> float:
    """The loss on `data` with the layers `removed` skipped in one pass, resumed from the
    baseline state entering the first removed layer (`states` from trunk_states on data.inputs)."""
    return float(_loss_without(adapter, states, data, removed))


def _loss_without(
    adapter: ModelAdapter, states: list, data: ScoredTokens, removed: list[int]
) -> torch.Tensor:
    """loss_without as a 0-dim tensor on the model's device, for the caller to read once."""
    if not removed:
        return data.loss(adapter.logits(states[-1]))
    first = min(removed)
    state = states[first - 1]
    drop = set(removed)
    for layer in range(first, adapter.n_layer + 1):
        state = adapter.skip(state, layer) if layer in drop else adapter.step(state, layer)
    return data.loss(adapter.logits(state))


@torch.no_grad()
def removal_losses(
    adapter: ModelAdapter,
    sets: list[tuple[str, int, int, list[int]]],
    data: dict[str, ScoredTokens],
) -> tuple[dict[str, float], list[dict]]:
    """The full model's loss per domain, and one row per removal set with its loss per domain
    (`data`: domain -> scored tokens, e.g. "val" and the NLL domains, on the model's device).
    Each domain's baseline pass is made once and shared by every set; a domain's losses are
    read from the device once, all sets together."""
    full: dict[str, float] = {}
    rows = [{"ranking": r, "draw": d, "k": k, "removed": layers} for r, d, k, layers in sets]
    for domain, scored in data.items():
        states = trunk_states(adapter, scored.inputs)
        losses = [_loss_without(adapter, states, scored, row["removed"]) for row in rows]
        full[domain], *by_set = torch.stack(
            [_loss_without(adapter, states, scored, []), *losses]
        ).tolist()
        for row, value in zip(rows, by_set):
            row[domain] = value
        del states
    return full, rows
