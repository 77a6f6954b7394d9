"""FLOP estimates and the hardware peaks used for MFU.

MFU = (tokens per second per rank) x (training FLOPs per token) / (one device's peak), i.e. the
global tokens per second divided by world_size x peak (each rank holds one device). Two peaks:
- `spec_peak_flops`: the vendor's dense (no sparsity) bf16 tensor-core peak from the table below,
  halved for float32 (TF32); None ("unknown") for a GPU that is not in the table, so that MFU is
  NaN and a log line says why, never a silent NaN or a wrong neighbour's number;
- `measured_matmul_peak`: the best throughput of one large matmul measured at start on this
  device in the run's dtype (`mfu_measured`); on the CPU, which has no spec-sheet peak, it is the
  only peak, and `mfu` equals `mfu_measured`.
"""

from __future__ import annotations

import re
import sys
import time
from functools import lru_cache

import torch

# Dense bf16 peak (no sparsity) in FLOP/s, matched against torch.cuda.get_device_name() in this
# order: the first pattern that matches wins, so the variants come before their family. Names as
# the driver reports them: "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
# "NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe",
# "NVIDIA B200". Numbers from NVIDIA's data sheets (the sparse figure there is twice these).
GPU_BF16_PEAK: tuple[tuple[str, str, float], ...] = (
    (r"GH200", "GH200", 989e12),
    (r"H200\s*NVL", "H200 NVL", 835e12),
    (r"H200", "H200", 989e12),
    (r"H100\s*NVL", "H100 NVL", 835e12),
    (r"H100\s*PCIe", "H100 PCIe", 756e12),
    (r"H100", "H100 SXM", 989e12),
    (r"B200", "B200", 2250e12),
    (r"A100", "A100", 312e12),
    (r"L40S", "L40S", 362e12),
    (r"\bA10\b", "A10", 125e12),
    (r"4090", "RTX 4090", 165e12),
)


def train_flops_per_token(model, seq_len: int) -> float:
    """Training matmul FLOPs per token: 3 x the forward count of depthbench.models.cost (6 N_mm plus
    attention over the full T x T square plus the architecture's depth terms)."""
    from depthbench.models.cost import forward_flops_per_token

    return 3.0 * forward_flops_per_token(model, seq_len)


def gpu_peak(name: str) -> tuple[str, float] | None:
    """(label, dense bf16 peak) of the GPU called `name`, or None when it is not in the table."""
    for pattern, label, peak in GPU_BF16_PEAK:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label, peak
    return None


def spec_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The spec-sheet peak of `device` for `dtype`; None where there is none (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    found = gpu_peak(torch.cuda.get_device_name(device))
    if found is None:
        return None
    return found[1] if dtype in (torch.bfloat16, torch.float16) else found[1] / 2  # fp32: TF32 rate


def measured_matmul_peak(
    device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 5
) -> float:
    """Best-of-`repeats` throughput of one size x size matmul on `device` in `dtype` (FLOP/s).
    The operands come from a private generator, so measuring does not move the run's RNG."""
    size = size or (8192 if device.type == "cuda" else 1024)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    a @ b  # warm-up: kernel selection, allocator
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


@lru_cache(maxsize=None)
def measured_cpu_peak(
    dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 5
) -> float:
    """Matmul throughput measured now on this CPU with the current thread count (best of n)."""
    return measured_matmul_peak(torch.device("cpu"), dtype, size, repeats)


@lru_cache(maxsize=None)
def measured_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The measured matmul peak that `mfu_measured` divides by, once per process and device."""
    if device.type != "cuda":
        return measured_cpu_peak(dtype)
    return measured_matmul_peak(device, dtype)


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The peak `mfu` divides by: the spec sheet's on a GPU (None when the GPU is unknown, with a
    line on stderr), the measured matmul peak on the CPU."""
    if device.type != "cuda":
        return measured_cpu_peak(dtype)
    peak = spec_peak_flops(device, dtype)
    if peak is None:
        print(
            f"MFU: peak of {torch.cuda.get_device_name(device)!r} unknown (not in "
            "depthbench.train.flops.GPU_BF16_PEAK); mfu is NaN, "
            "mfu_measured uses the measured matmul peak",
            file=sys.stderr,
        )
    return peak


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, world_size: int) -> float:
    """Model FLOPs utilisation per rank: global tokens/s over world_size devices of `peak` each."""
    if peak is None or not peak > 0:
        return float("nan")
    return tokens_per_s * flops_per_token / (peak * world_size)
