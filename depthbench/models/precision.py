"""Autocast as model code meets it, on the meta device too.

torch.autocast refuses the meta device, on which the memory estimate
(depthbench.train.activation_trace) traces a model while it replays a target device's autocast
casts (depthbench.train.meta_autocast). The places that turn autocast off for a region, or ask
which dtype autocast runs a product in, go through this module, so that on meta the replay in
force answers them instead:

- `autocast_off(device_type)`: torch.autocast(device_type, enabled=False); on meta the replay's
  casts pause for the region (nothing happens without a replay).
- `autocast_dtype(x)`: the dtype autocast runs x's matrix products in: autocast's where it is on
  for x's device, x's own otherwise; on meta the replay's while it casts.
- `replay()`: the `Replay` in force (the innermost `replaying(...)`), or None.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch


@dataclass
class Replay:
    """The autocast a meta-device trace replays: the target `device` type ("cpu", "cuda"), whose
    policy and paths the trace follows, and whether it casts to `dtype` at this point."""

    device: str
    enabled: bool
    dtype: torch.dtype = torch.bfloat16


_replays: list[Replay] = []  # innermost last; only a trace in progress holds one


@contextmanager
def replaying(state: Replay):
    """Install `state` as the replay in force for the region (the meta trace's)."""
    _replays.append(state)
    try:
        yield state
    finally:
        _replays.remove(state)


def replay() -> Replay | None:
    return _replays[-1] if _replays else None


@contextmanager
def _paused(state: Replay):
    enabled = state.enabled
    state.enabled = False
    try:
        yield
    finally:
        state.enabled = enabled


def autocast_off(device_type: str):
    """A region with autocast off on `device_type`; on meta, the replay's casts paused."""
    if device_type != "meta":  # a plain branch on a string: torch.compile folds it
        return torch.autocast(device_type, enabled=False)
    state = replay()
    return _paused(state) if state is not None else nullcontext()


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matrix products of x run in (as `@` would be cast)."""
    kind = x.device.type
    if kind == "meta":
        state = replay()
        return state.dtype if state is not None and state.enabled else x.dtype
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype
