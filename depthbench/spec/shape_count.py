"""A model shape and its parameter count.

Parameters are counted on the model as built (embeddings, norms and any extra parameters of the
architecture included), by instantiating it on the meta device, so the count is exact for every
registered architecture without a closed form per architecture. The solver that picks shapes at
a budget is depthbench.spec.shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache

from depthbench.models.config import ModelConfig, swiglu_hidden


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


def _config_for(
    base: ModelConfig, n_layer: int, d_model: int, d_ff: int | None, ff_multiple: int
) -> ModelConfig:
    return replace(
        base,
        n_layer=n_layer,
        d_model=d_model,
        d_ff=d_ff if d_ff is not None else swiglu_hidden(d_model, ff_multiple),
    )


def extrapolated_params(
    base: ModelConfig, n_layer: int, d_model: int, d_ff: int | None, ff_multiple: int
) -> int:
    """Parameter count as built; fast path extrapolates from the 1- and 2-layer models.

    Every architecture's parameter count is affine in depth at fixed width (identical blocks
    plus depth-independent embeddings). The search uses that; `_exact` checks the final pick.
    """
    key = json.dumps(base.to_dict(), sort_keys=True)
    p1 = _params_cached(key, 1, d_model, d_ff, ff_multiple)
    p2 = _params_cached(key, 2, d_model, d_ff, ff_multiple)
    return p1 + (n_layer - 1) * (p2 - p1)


def _exact(
    base: ModelConfig, n_layer: int, d_model: int, d_ff: int | None, ff_multiple: int
) -> int:
    exact = _params_cached(
        json.dumps(base.to_dict(), sort_keys=True), n_layer, d_model, d_ff, ff_multiple
    )
    predicted = extrapolated_params(base, n_layer, d_model, d_ff, ff_multiple)
    if exact != predicted:
        raise AssertionError(
            f"architecture {base.arch!r}: parameter count is not affine in depth "
            f"({exact} built vs {predicted} extrapolated); the shape solver needs an exact search"
        )
    return exact


@lru_cache(maxsize=8192)
def _params_cached(
    base_json: str, n_layer: int, d_model: int, d_ff: int | None, ff_multiple: int
) -> int:
    base = ModelConfig.from_dict(json.loads(base_json))
    # imported here: counting builds a model (torch), which reading a RunSpec never needs
    from depthbench.models.registry import count_parameters

    return count_parameters(_config_for(base, n_layer, d_model, d_ff, ff_multiple))


def shape_of(
    base: ModelConfig, n_layer: int, d_model: int, d_ff: int | None = None, ff_multiple: int = 64
) -> Shape:
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
