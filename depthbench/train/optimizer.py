"""The optimizer: `torch.optim.AdamW` itself, without importing torch._dynamo in eager mode.

Three methods of torch's optimizers carry decorators that only matter while torch.compile traces
them: `add_param_group` and `zero_grad` are wrapped by `torch._disable_dynamo` and `step` by
`_use_grad_for_differentiable`, and each wrapper imports torch._dynamo on its first call, in eager
mode too. A short training job would pay that import at `AdamW(...)` (most of the "dispatcher's own
work" of a default-grid job, docs/benchmarks.md#per-job-start-up). The DepthBench training loop
never compiles the optimizer (`train.compile` compiles the model's blocks), so `AdamW` below calls
the undecorated functions (`__wrapped__`, which `functools.wraps` sets), with the gradient mode that
`step`'s wrapper sets: the same class, state, hyperparameters, kernels (fused on CPU and CUDA) and
update, bit for bit (tests/unit/test_optimizer.py compares it with `torch.optim.AdamW` over several
steps; tests/integration/test_start_up_imports.py checks that training imports no torch._dynamo).
`state_dict` and `load_state_dict` keep their decorators: checkpoints go through
torch.distributed.checkpoint, which imports torch._dynamo itself.
"""

from __future__ import annotations

from typing import Any

import torch


def _undecorated(method):
    """The function a torch decorator wrapped (itself where nothing is wrapped)."""
    return getattr(method, "__wrapped__", method)


_ADD_PARAM_GROUP = _undecorated(torch.optim.Optimizer.add_param_group)
_ZERO_GRAD = _undecorated(torch.optim.Optimizer.zero_grad)
_STEP = _undecorated(torch.optim.AdamW.step)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose eager calls do not import torch._dynamo (module docstring)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _ZERO_GRAD(self, set_to_none)

    def step(self, closure=None):
        # what _use_grad_for_differentiable does around the update, without its graph breaks
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return _STEP(self, closure)
