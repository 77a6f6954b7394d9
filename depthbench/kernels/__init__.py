"""DepthBench's fast implementations and the CPU C++ kernels they use.

The architectures (depthbench/models/archs) are written in plain PyTorch: their definitions. The
modules of this package hold faster implementations of some of their modules, and
`depthbench.kernels.swap.swap_in(model, device, kernels)` puts them in place for the device's
backend: C++ kernels and aten's fused CPU attention on the CPU, Triton kernels (Liger-Kernel's)
and batched PyTorch on CUDA. The tests hold every implementation to the definition it replaces.

This module builds the C++ kernels: `cpu_kernels()` compiles the `.cpp` files beside it with
`torch.utils.cpp_extension.load` (needs a C++ compiler and the `ninja` package, installed by
scripts/setup.sh, which runs `python -m depthbench.kernels`) and caches the build in a directory
named after the Python and torch versions and a hash of the sources and flags, under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions): the first call in a new environment
compiles, later ones only load. Concurrent first calls (parallel workflow jobs)
wait on the build's lock file; a lock left by a build that was killed is removed once it is older
than `STALE_LOCK_SECONDS`, so a later run does not wait forever. Where the build is impossible,
or DEPTHBENCH_CPU_KERNELS=0 asks, it returns None once with a warning and the swapped modules run
their definitions: the kernels change speed, never definitions.

The C++ sources, each wrapped as torch custom ops and eager autograd Functions in a Python module
beside it:
- mhc.cpp (`mhc_ops.py`): `mhc_read_forward(H, W, scale, bias, eps, iterations)` and
  `mhc_read_backward(...)`, mHC's whole read (flattened RMS, projection, coefficients with the
  Sinkhorn-Knopp iterations, read and mix) from the streams; and `mhc_coefficients_forward(u, n,
  iterations)` / `_backward(...)`, the coefficients alone from their pre-activations
  (`fused_coefficients`: bf16 streams on the CPU).
- hc.cpp (`hc_ops.py`, `stream_ops.py`): `hc_read_forward(H, W, S, eps, scale)` and
  `hc_read_backward(...)`, Hyper-Connections' whole read (per-stream RMS, dynamic projection,
  tanh, read and mix); and `stream_write_backward(grad, w, out)`, the backward of both
  architectures' write H = mixed + w^T out (`stream_ops.write_after_read`).
- common.h: the CPU dispatch (an x86-64-v3 clone beside the baseline one), vector helpers, and
  the vectorised exp and tanh.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(name) for name in ("mhc.cpp", "hc.cpp")
]
_HEADERS = [Path(__file__).with_name("common.h")]
# -ffp-contract=fast: a * b + c as one fused multiply-add (ISO C++ mode would keep them apart);
# -Wno-psabi: the 32-byte vector types of hc.cpp only pass between always-inlined functions;
# -fopenmp: at::parallel_for is an OpenMP loop in ATen's headers, serial without it (the GOMP
# calls resolve to the libgomp that libtorch_cpu loads, so no second OpenMP runtime is linked)
_CFLAGS = ["-O3", "-ffp-contract=fast", "-Wno-psabi", "-fopenmp"]
STALE_LOCK_SECONDS = 15 * 60  # many times a build's time
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """False when DEPTHBENCH_CPU_KERNELS is set to 0 / false / no / off."""
    return os.environ.get("DEPTHBENCH_CPU_KERNELS", "1").strip().lower() not in {
        "0",
        "false",
        "no",
        "off",
    }


def built() -> bool:
    """Whether the kernels are loaded (building them on the first call); a constant to
    torch.compile, which calls it once while tracing (marked below)."""
    return cpu_kernels() is not None


# What torch.compiler.assume_constant_result(built) does in torch 2.13 (torch._dynamo.decorators:
# it sets this attribute and returns the function), without importing torch._dynamo: that import
# (with sympy) is a large part of the start-up of every workflow job that builds a model,
# compiling or not (docs/benchmarks.md#per-job-start-up).
# tests/unit/test_cpu_kernels.py checks that the decorator still marks a function exactly so.
built._dynamo_marked_constant = True


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
            # -fopenmp where the compiler has it; otherwise (Apple clang) the same kernels, serial
            for flags in (_CFLAGS, [f for f in _CFLAGS if f != "-fopenmp"]):
                build_dir = build_directory(flags)
                build_dir.mkdir(parents=True, exist_ok=True)
                _remove_stale_lock(build_dir)
                try:
                    return load(
                        name="depthbench_cpu_kernels",
                        sources=[str(s) for s in _SOURCES],
                        extra_cflags=flags,
                        build_directory=str(build_dir),
                        verbose=False,
                    )
                except Exception:
                    if "-fopenmp" not in flags:
                        raise
                    log.info(
                        "DepthBench CPU kernels: the build with -fopenmp failed; "
                        "building them serial"
                    )
        except Exception as exc:  # a failed compile: fall back, and say why
            reason = (
                f"build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
            )
    log.warning(
        "DepthBench CPU kernels unavailable (%s); using the PyTorch code, which is slower", reason
    )
    return None


def build_directory(flags: list[str] | None = None) -> Path:
    """Where the extension is built and cached: one directory per Python, torch, machine
    architecture, checkout and version of the sources and flags, so versions never overwrite each
    other. The checkout's path counts because torch's build file names the sources by absolute
    path: two checkouts sharing a directory would rebuild in turn, each waiting on the other's
    lock."""
    root = Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    )
    digest = hashlib.sha256(str(Path(__file__).resolve().parent).encode())
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(_CFLAGS if flags is None else flags).encode())
    py = "".join(platform.python_version_tuple()[:2])
    tag = f"py{py}-torch{torch.__version__}-{platform.machine()}-{digest.hexdigest()[:12]}"
    return root / "depthbench" / tag


def _remove_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"  # torch's FileBaton
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        log.warning(
            "removing %s, left %.0f minutes ago by a build that did not finish", lock, age / 60
        )
        lock.unlink(missing_ok=True)
