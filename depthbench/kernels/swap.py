"""The one place where fast implementations replace the architectures' PyTorch definitions.

An architecture module (depthbench/models/archs) holds its equations in plain PyTorch: the
definition, which never asks for a device or a kernel. `swap_in(model, device, kernels)` walks the
model and gives each module whose class has a faster implementation for the device's backend that
implementation's class: a subclass of the module's own class with the same parameters, buffers
and state-dict names, whose forward runs kernels where they take the input and the definition
(`super().forward`) where they do not (another dtype or device, a meta trace). `swap_out` gives
every module its definition's class back. This is torchtitan's model-converter pattern: the
models know nothing of the kernels, and what runs where is decided here. FSDP2's `fully_shard` and
the unit wrappers of depthbench.train.parallelize apply after the swap (FSDP2 subclasses the class
it finds).

Backends and what they swap in (each module's SWAPS):
- `cpu`: HC's and mHC's read and write in C++ (cpu_streams.py; built by `python -m
  depthbench.kernels`), MoDA's joint attention over aten's CPU flash-attention pair
  (moda_fused.py).
- `cuda`: HC's and mHC's read, coefficients and write through Liger-Kernel's Triton kernels
  (triton_streams.py), MoDA's joint attention with its causal chunk in fla-core's Triton
  attention (moda_triton.py; without fla-core, a chunked online-softmax pair, moda_fused.py),
  Full and Block AttnRes's depth mix in two phases over groups of readers, its products over
  the sources in Triton (attnres_triton.py; without triton, in PyTorch: attnres_groups.py).

`kernels`: `auto` swaps in the backend's implementations, `reference` runs the definitions
everywhere (the `train.kernels` setting; the environment variable DEPTHBENCH_KERNELS, when set,
overrides it for every stage, probes and evaluation included). Implementations whose library is
missing (liger-kernel or fla-core for the CUDA backend) are left out with one warning, and the
definition runs (for MoDA without fla-core, the chunked pair).
"""

from __future__ import annotations

import importlib
import logging
import os

import torch
from torch import nn

from depthbench.util.errors import ConfigError

log = logging.getLogger(__name__)

KERNELS = ("auto", "reference")
BACKENDS = ("cpu", "cuda")
# the modules that declare implementations: SWAPS {(backend, definition class): class} and,
# where a library may be missing, unavailable_reason()
IMPLEMENTATIONS = (
    "cpu_streams",
    "triton_streams",
    "attnres_groups",
    "attnres_triton",  # after attnres_groups: where triton is installed, its AttnRes replaces it
    "moda_fused",
    "moda_triton",  # after moda_fused: where it can run, its MoDA layer replaces the chunked one
)

_warned: set[str] = set()


def check_kernels(value: str, field: str = "train.kernels") -> str:
    if value not in KERNELS:
        raise ConfigError(field, f"{value!r}; valid: {list(KERNELS)}")
    return value


def resolve_kernels(setting: str = "auto") -> str:
    """The setting in force: DEPTHBENCH_KERNELS when set, else `setting`."""
    override = os.environ.get("DEPTHBENCH_KERNELS", "").strip()
    if override:
        return check_kernels(override, "DEPTHBENCH_KERNELS")
    return check_kernels(setting)


def backend_for(device: torch.device | str) -> str | None:
    """The backend whose implementations suit `device` (None: only the definitions)."""
    kind = torch.device(device).type
    return kind if kind in BACKENDS else None


def implementations(backend: str) -> dict[type, type]:
    """{definition class: implementation class} of `backend`, from every module that can run."""
    table: dict[type, type] = {}
    for name in IMPLEMENTATIONS:
        module = importlib.import_module(f"depthbench.kernels.{name}")
        entries = {cls: impl for (b, cls), impl in module.SWAPS.items() if b == backend}
        if not entries:
            continue
        reason = getattr(module, "unavailable_reason", lambda: None)()
        if reason is not None:
            if name not in _warned:
                _warned.add(name)
                log.warning("%s kernels unavailable (%s): left out", name, reason)
            continue
        table.update(entries)
    return table


def swap_in(
    model: nn.Module, device: torch.device | str | None = None, kernels: str = "auto"
) -> nn.Module:
    """Give the model's modules the implementations of `device`'s backend (default: the device of
    the model's parameters; module docstring); `kernels` = reference gives them their
    definitions. In place; returns the model."""
    kernels = resolve_kernels(kernels)
    if device is None:
        device = next(model.parameters()).device
    swap_out(model)
    backend = backend_for(device)
    if kernels == "reference" or backend is None:
        return model
    table = implementations(backend)
    for module in model.modules():
        impl = table.get(type(module))
        if impl is not None:
            module.__class__ = impl
    return model


def swap_out(model: nn.Module) -> nn.Module:
    """Give every swapped module its definition's class back. In place; returns the model."""
    for module in model.modules():
        definition = _definition_of(type(module))
        if definition is not None:
            module.__class__ = definition
    return model


def _definition_of(cls: type) -> type | None:
    for name in IMPLEMENTATIONS:
        module = importlib.import_module(f"depthbench.kernels.{name}")
        for (_, definition), impl in module.SWAPS.items():
            if impl is cls:
                return definition
    return None


def swapped(model: nn.Module) -> dict[str, str]:
    """{module path: implementation class name} of the swapped modules (for logs and tests)."""
    return {
        name: type(module).__name__
        for name, module in model.named_modules()
        if _definition_of(type(module)) is not None
    }
