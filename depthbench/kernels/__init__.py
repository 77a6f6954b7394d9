"""Optional C++ kernels for the CPU, compiled on first use.

`cpu_kernels()` builds the extension from the `.cpp` files beside this module with
`torch.utils.cpp_extension.load` (needs a C++ compiler and the `ninja` package, both installed
by scripts/setup.sh on Linux) and caches the build (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions): the first call in a new environment compiles for about a minute,
later ones only load. Where the build is impossible, or DEPTHBENCH_CPU_KERNELS=0 asks, it
returns None once with a warning and callers keep their PyTorch code: the kernels change speed,
never results (tests compare them with the PyTorch code they replace).

Kernels (mhc.cpp), used by `depthbench.models.archs.mhc`: `sinkhorn_forward(m, iterations)` and
`sinkhorn_backward(m, grad, iterations)` (Sinkhorn-Knopp on (n, n, ...) matrices), and
`mhc_coefficients_forward(u, n, iterations)` / `mhc_coefficients_backward(u, grad_coeff,
grad_post, n, iterations)` (mHC's read, mix and write coefficients from their pre-activations).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name("mhc.cpp")]
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """False when DEPTHBENCH_CPU_KERNELS is set to 0 / false / no / off."""
    return os.environ.get("DEPTHBENCH_CPU_KERNELS", "1").strip().lower() not in {"0", "false", "no", "off"}


def unavailable_reason() -> str | None:
    """Why the kernels cannot be built here, or None when nothing is known to stand in the way."""
    if not enabled():
        return "DEPTHBENCH_CPU_KERNELS=0"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH (set CXX or install g++)"
    try:
        import ninja  # noqa: F401  (torch's JIT build runs ninja)
    except ImportError:
        return "the ninja package is not installed (pip install ninja)"
    return None


def cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, or None (with one warning) where it cannot be built."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
    return _state["module"]


def _build() -> ModuleType | None:
    reason = unavailable_reason()
    if reason is None:
        try:
            from torch.utils.cpp_extension import load

            # ninja is found through PATH: make the venv's own copy visible when it is not
            import ninja

            bin_dir = getattr(ninja, "BIN_DIR", None)
            if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
            return load(name="depthbench_cpu_kernels", sources=[str(s) for s in _SOURCES],
                        extra_cflags=["-O3"], verbose=False)
        except Exception as exc:  # a failed compile: fall back, and say why
            reason = f"build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
    log.warning("DepthBench CPU kernels unavailable (%s); using the PyTorch code, which is slower", reason)
    return None
