"""Shape solver: at a fixed parameter budget, pick d_model for a depth (or a depth for a ratio).

Parameters are counted on the model as built (embeddings, norms and any extra parameters of the
architecture included), by instantiating it on the meta device, so the solver is exact for every
registered architecture without a closed form per architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache

from depthbench.errors import ConfigError
from depthbench.models import ModelConfig, count_parameters, swiglu_hidden


@dataclass(frozen=True)
class Shape:
    n_layer: int
    d_model: int
    d_ff: int
    n_head: int
    n_kv_head: int
    n_params: int

    @property
    def ratio(self) -> float:
        return self.d_model / self.n_layer

    @property
    def tag(self) -> str:
        return f"L{self.n_layer}-d{self.d_model}"


def _config_for(base: ModelConfig, n_layer: int, d_model: int, d_ff: int | None, ff_multiple: int) -> ModelConfig:
    return replace(
        base,
        n_layer=n_layer,
        d_model=d_model,
        d_ff=d_ff if d_ff is not None else swiglu_hidden(d_model, ff_multiple),
    )


def _params(base: ModelConfig, n_layer: int, d_model: int, d_ff: int | None, ff_multiple: int) -> int:
    """Parameter count as built; fast path extrapolates from the 1- and 2-layer models.

    Every architecture's parameter count is affine in depth at fixed width (identical blocks
    plus depth-independent embeddings). The search uses that; `_exact` checks the final pick.
    """
    key = json.dumps(base.to_dict(), sort_keys=True)
    p1 = _params_cached(key, 1, d_model, d_ff, ff_multiple)
    p2 = _params_cached(key, 2, d_model, d_ff, ff_multiple)
    return p1 + (n_layer - 1) * (p2 - p1)


def _exact(base: ModelConfig, n_layer: int, d_model: int, d_ff: int | None, ff_multiple: int) -> int:
    exact = _params_cached(json.dumps(base.to_dict(), sort_keys=True), n_layer, d_model, d_ff, ff_multiple)
    predicted = _params(base, n_layer, d_model, d_ff, ff_multiple)
    if exact != predicted:
        raise AssertionError(
            f"architecture {base.arch!r}: parameter count is not affine in depth "
            f"({exact} built vs {predicted} extrapolated); the shape solver needs an exact search"
        )
    return exact


@lru_cache(maxsize=8192)
def _params_cached(base_json: str, n_layer: int, d_model: int, d_ff: int | None, ff_multiple: int) -> int:
    base = ModelConfig.from_dict(json.loads(base_json))
    return count_parameters(_config_for(base, n_layer, d_model, d_ff, ff_multiple))


def _valid_width(d_model: int, base: ModelConfig) -> bool:
    return d_model % base.n_head == 0 and (d_model // base.n_head) % 2 == 0


def solve_width(
    base: ModelConfig,
    n_layer: int,
    budget: float,
    multiple: int = 64,
    ff_multiple: int = 64,
    d_ff: int | None = None,
    field: str = "shapes",
) -> Shape:
    """The d_model (a multiple of `multiple`) whose built model comes closest to `budget`."""
    if n_layer < 1:
        raise ConfigError(field, f"n_layer must be >= 1, got {n_layer}")
    candidates = [k * multiple for k in range(1, 4097) if _valid_width(k * multiple, base)]
    if not candidates:
        raise ConfigError(field, f"no multiple of {multiple} is divisible by n_head {base.n_head}")
    lo, hi = 0, len(candidates) - 1
    # Parameters grow monotonically with width: binary search for the first width over budget.
    while lo < hi:
        mid = (lo + hi) // 2
        if _params(base, n_layer, candidates[mid], d_ff, ff_multiple) < budget:
            lo = mid + 1
        else:
            hi = mid
    best = min(
        (candidates[i] for i in (lo - 1, lo) if 0 <= i < len(candidates)),
        key=lambda d: abs(_params(base, n_layer, d, d_ff, ff_multiple) - budget),
    )
    n_params = _params(base, n_layer, best, d_ff, ff_multiple)
    if abs(n_params - budget) > 0.5 * budget:
        raise ConfigError(
            field,
            f"impossible shape: at n_layer={n_layer} the closest width d_model={best} gives "
            f"{n_params:,} parameters, more than 50% away from the budget {budget:,.0f}; "
            "use fewer layers or a larger budget",
        )
    return shape_of(base, n_layer, best, d_ff, ff_multiple)


def shape_of(base: ModelConfig, n_layer: int, d_model: int, d_ff: int | None = None, ff_multiple: int = 64) -> Shape:
    """The shape with explicit width (d_ff defaults to 8/3 d rounded to `ff_multiple`)."""
    cfg = _config_for(base, n_layer, d_model, d_ff, ff_multiple)
    return Shape(
        n_layer=n_layer,
        d_model=d_model,
        d_ff=cfg.d_ff,
        n_head=cfg.n_head,
        n_kv_head=cfg.n_kv_head,
        n_params=_exact(base, n_layer, d_model, d_ff, ff_multiple),
    )


def solve_ratio(
    base: ModelConfig,
    ratio: float,
    budget: float,
    multiple: int = 64,
    ff_multiple: int = 64,
    max_layers: int = 512,
    field: str = "shapes",
) -> Shape:
    """The depth whose solved width gives d_model / n_layer closest to `ratio`."""
    if ratio <= 0:
        raise ConfigError(field, f"ratio must be positive, got {ratio}")
    best: Shape | None = None
    lo, hi = 1, max_layers
    # d(L)/L decreases with L: binary search for the crossing, then compare its neighbours.
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            r = solve_width(base, mid, budget, multiple, ff_multiple, field=field).ratio
        except ConfigError:
            r = 0.0
        if r > ratio:
            lo = mid + 1
        else:
            hi = mid
    for n_layer in (lo - 1, lo):
        if n_layer < 1:
            continue
        try:
            shape = solve_width(base, n_layer, budget, multiple, ff_multiple, field=field)
        except ConfigError:
            continue
        if best is None or abs(shape.ratio - ratio) < abs(best.ratio - ratio):
            best = shape
    if best is None:
        raise ConfigError(field, f"impossible shape: no depth reaches ratio {ratio} at budget {budget:,.0f}")
    return best
