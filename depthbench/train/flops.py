"""FLOP estimates and the hardware peak used for MFU."""

from __future__ import annotations

import time
from functools import lru_cache

import torch


# Dense bf16 peak (no sparsity) in FLOP/s, by substring of torch.cuda.get_device_name().
GPU_BF16_PEAK = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "4090": 165e12,
}


def train_flops_per_token(model, seq_len: int) -> float:
    """Training matmul FLOPs per token: 3 x the forward count of depthbench.cost (6 N_mm plus
    attention over the full T x T square plus the architecture's depth terms)."""
    from depthbench.cost import forward_flops_per_token

    return 3.0 * forward_flops_per_token(model, seq_len)


@lru_cache(maxsize=None)
def measured_cpu_peak(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 5) -> float:
    """Matmul throughput measured now on this CPU with the current thread count (best of n)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_BF16_PEAK.items():
            if key in name:
                return peak if dtype == torch.bfloat16 else peak / 2
        return float("nan")
    return measured_cpu_peak(dtype)
