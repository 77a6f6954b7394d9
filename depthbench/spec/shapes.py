"""Shape solver: at a fixed parameter budget, pick d_model for a depth (or a depth for a ratio).

Parameters are counted on the model as built (depthbench.spec.shape_count), so the solver is
exact for every registered architecture without a closed form per architecture.

The budget is fixed to `budget.tolerance` (default 1%) per architecture and shape:
d_model is picked on its multiple (the width whose model with SwiGLU's d_ff = 8/3
d_model comes closest), so the 400M preset keeps the paper's widths; then d_ff absorbs the
residual on a finer multiple (`budget.d_ff_step`, default 8) inside 8/3 d_model +- 15%, which
moves the count in steps of 3 d_model n_layer d_ff_step. Each architecture gets its own d_ff
(mHC's extra parameters come out of its FFN). Only when that width cannot reach the tolerance
are its neighbours tried; when none can, the shape is a ConfigError naming it and the nearest
reachable counts. The tiny default uses a d_model multiple of 8 (16 misses 0.8M by 20% at L=8
with d_ff inside the band) and d_ff_step 4. Explicit `n_layer` + `d_model` shapes are not solved.
"""

from __future__ import annotations

import math

from depthbench.util.errors import ConfigError
from depthbench.models.config import ModelConfig
from depthbench.spec.shape_count import Shape, extrapolated_params, shape_of

FF_RATIO = 8 / 3  # SwiGLU's d_ff / d_model (LLaMA)
FF_BAND = 0.15  # d_ff / d_model stays within 15% of 8/3 while absorbing the budget residual


def _valid_width(d_model: int, base: ModelConfig) -> bool:
    return d_model % base.n_head == 0 and (d_model // base.n_head) % 2 == 0


def _pick_width(
    base: ModelConfig,
    n_layer: int,
    budget: float,
    candidates: list[int],
    d_ff: int | None,
    ff_multiple: int,
) -> int:
    """Index of the width whose model at the default d_ff (8/3 d on `ff_multiple`) is closest."""
    lo, hi = 0, len(candidates) - 1
    # Parameters grow monotonically with width: binary search for the first width over budget.
    while lo < hi:
        mid = (lo + hi) // 2
        if extrapolated_params(base, n_layer, candidates[mid], d_ff, ff_multiple) < budget:
            lo = mid + 1
        else:
            hi = mid
    return min(
        (i for i in (lo - 1, lo) if 0 <= i < len(candidates)),
        key=lambda i: abs(
            extrapolated_params(base, n_layer, candidates[i], d_ff, ff_multiple) - budget
        ),
    )


def ff_band(d_model: int, ff_step: int) -> tuple[int, int]:
    """The d_ff values on `ff_step` with d_ff / d_model within FF_BAND of 8/3: (lowest, highest)."""
    lo = math.ceil(FF_RATIO * (1 - FF_BAND) * d_model / ff_step) * ff_step
    hi = math.floor(FF_RATIO * (1 + FF_BAND) * d_model / ff_step) * ff_step
    return lo, hi


def _close_gap(
    base: ModelConfig, n_layer: int, d_model: int, budget: float, ff_step: int
) -> tuple[int, int] | None:
    """(d_ff, parameters): the d_ff on `ff_step` inside the 8/3 band whose count is closest.

    The count is affine in d_ff at fixed depth and width (each layer's SwiGLU has 3 d d_ff
    weights, experts included), so the two band ends give the slope; the rounded solution and
    its neighbours are then counted as built.
    """
    lo, hi = ff_band(d_model, ff_step)
    if lo > hi:
        return None
    p_lo = extrapolated_params(base, n_layer, d_model, lo, ff_step)
    if hi == lo:
        return lo, p_lo
    slope = (extrapolated_params(base, n_layer, d_model, hi, ff_step) - p_lo) / (hi - lo)
    k = round((budget - p_lo) / slope / ff_step)
    d_ff = min(hi, max(lo, lo + k * ff_step))
    n_params = extrapolated_params(base, n_layer, d_model, d_ff, ff_step)
    if n_params == p_lo + round(slope * (d_ff - lo)):
        return d_ff, n_params  # affine as expected: the rounded solution is the closest
    options = {min(hi, max(lo, d_ff + j * ff_step)) for j in (-1, 0, 1)}
    return min(
        ((f, extrapolated_params(base, n_layer, d_model, f, ff_step)) for f in options),
        key=lambda fp: abs(fp[1] - budget),
    )


def _width_pick(
    base: ModelConfig,
    n_layer: int,
    budget: float,
    multiple: int,
    ff_multiple: int,
    d_ff: int | None,
    field: str,
) -> tuple[list[int], int]:
    """The candidate widths (multiples of `multiple` valid for the heads) and the index of the
    one whose model with d_ff at 8/3 comes closest to the budget; ConfigError when no width
    comes within 50% of it."""
    if n_layer < 1:
        raise ConfigError(field, f"n_layer must be >= 1, got {n_layer}")
    # Every architecture embeds the vocabulary (vocab_size x d_model weights), so wider models
    # than 1.5 budget / vocab_size fail the 50% check below anyway: a shorter binary search.
    widest = max(multiple, int(1.5 * budget / base.vocab_size))
    candidates = [
        k * multiple
        for k in range(1, min(4096, widest // multiple) + 2)
        if _valid_width(k * multiple, base)
    ]
    if not candidates:
        raise ConfigError(field, f"no multiple of {multiple} is divisible by n_head {base.n_head}")
    i = _pick_width(base, n_layer, budget, candidates, d_ff, ff_multiple)
    n_params = extrapolated_params(base, n_layer, candidates[i], d_ff, ff_multiple)
    if abs(n_params - budget) > 0.5 * budget:
        raise ConfigError(
            field,
            f"impossible shape: at n_layer={n_layer} the closest width d_model={candidates[i]} "
            f"gives {n_params:,} parameters, more than 50% away from the budget {budget:,.0f}; "
            "use fewer layers or a larger budget",
        )
    return candidates, i


def solve_width(
    base: ModelConfig,
    n_layer: int,
    budget: float,
    multiple: int = 64,
    ff_multiple: int = 64,
    d_ff: int | None = None,
    field: str = "shapes",
    *,
    tolerance: float | None = 0.01,
    ff_step: int = 8,
) -> Shape:
    """The shape at depth `n_layer` whose built model is within `tolerance` of `budget`.

    1. d_model: the multiple of `multiple` whose model with d_ff = 8/3 d_model (rounded to
       `ff_multiple`) comes closest to the budget (so the 400M preset keeps the paper's widths).
    2. d_ff absorbs the residual: the value on the finer `ff_step` inside 8/3 d_model +- 15%
       whose count is closest to the budget (`_close_gap`). A pinned `d_ff` is kept as given.
    3. If that misses the tolerance, the neighbouring widths (up to 3 multiples either side,
       in order of step 1's distance) are tried the same way; the first within tolerance wins.
    None reaching it is a ConfigError naming `field` and the nearest reachable counts.
    `tolerance=None` skips steps 2-3 (the width-only pick, d_ff at 8/3).
    """
    candidates, i = _width_pick(base, n_layer, budget, multiple, ff_multiple, d_ff, field)
    if tolerance is None:
        return shape_of(base, n_layer, candidates[i], d_ff, ff_multiple)

    def widths():  # step 1's pick, then its neighbours by their 8/3 distance (counted lazily)
        yield candidates[i]
        window = [j for j in range(i - 3, i + 4) if 0 <= j < len(candidates) and j != i]
        yield from sorted(
            (candidates[j] for j in window),
            key=lambda d: abs(extrapolated_params(base, n_layer, d, d_ff, ff_multiple) - budget),
        )

    reached: list[tuple[int, int, int]] = []  # (parameters, d_model, d_ff) missing the tolerance
    for d_model in widths():
        if d_ff is not None:  # pinned: only d_model moves
            got = (d_ff, extrapolated_params(base, n_layer, d_model, d_ff, ff_multiple))
        else:
            got = _close_gap(base, n_layer, d_model, budget, ff_step)
        if got is None:
            continue
        if abs(got[1] - budget) <= tolerance * budget:
            return shape_of(base, n_layer, d_model, got[0], ff_multiple)
        reached.append((got[1], d_model, got[0]))
    raise ConfigError(field, _unreachable(n_layer, budget, tolerance, reached, d_ff is not None))


def _unreachable(
    n_layer: int, budget: float, tolerance: float, reached: list[tuple[int, int, int]], pinned: bool
) -> str:
    below = max((r for r in reached if r[0] < budget), default=None)
    above = min((r for r in reached if r[0] > budget), default=None)
    nearest = " and ".join(
        f"{r[0]:,} ({100 * (r[0] / budget - 1):+.2f}%, d_model={r[1]}, d_ff={r[2]})"
        for r in (below, above)
        if r is not None
    )
    fix = (
        "drop the pinned d_ff, "
        if pinned
        else "use a finer budget.d_ff_step or budget.d_model_multiple, "
    )
    return (
        f"at n_layer={n_layer} no shape is within budget.tolerance {tolerance:g} of the budget "
        f"{budget:,.0f} parameters; the nearest reachable counts are {nearest or 'none'}; "
        f"{fix}or a larger budget.tolerance"
    )


def solve_ratio(
    base: ModelConfig,
    ratio: float,
    budget: float,
    multiple: int = 64,
    ff_multiple: int = 64,
    max_layers: int = 512,
    field: str = "shapes",
    *,
    tolerance: float | None = 0.01,
    ff_step: int = 8,
) -> Shape:
    """The depth whose width (step 1 of `solve_width`) gives d_model / n_layer closest to
    `ratio`; that depth is then solved with the budget tolerance like an `n_layer` shape."""
    if ratio <= 0:
        raise ConfigError(field, f"ratio must be positive, got {ratio}")
    best: Shape | None = None
    lo, hi = 1, max_layers
    # d(L)/L decreases with L: binary search for the crossing, then compare its neighbours.
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            r = solve_width(
                base, mid, budget, multiple, ff_multiple, field=field, tolerance=None
            ).ratio
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
            shape = solve_width(
                base, n_layer, budget, multiple, ff_multiple, field=field, tolerance=None
            )
        except ConfigError:
            continue
        if best is None or abs(shape.ratio - ratio) < abs(best.ratio - ratio):
            best = shape
    if best is None:
        raise ConfigError(
            field, f"impossible shape: no depth reaches ratio {ratio} at budget {budget:,.0f}"
        )
    if tolerance is None:
        return best
    return solve_width(
        base,
        best.n_layer,
        budget,
        multiple,
        ff_multiple,
        field=field,
        tolerance=tolerance,
        ff_step=ff_step,
    )
