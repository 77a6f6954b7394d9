"""FLOP estimates and the hardware peak used for MFU."""

from __future__ import annotations

import time
from functools import lru_cache

import torch

from depthbench.models import ModelConfig

# Dense bf16 peak (no sparsity) in FLOP/s, by substring of torch.cuda.get_device_name().
GPU_BF16_PEAK = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "4090": 165e12,
}


def train_flops_per_token(cfg: ModelConfig, seq_len: int, n_params: int) -> float:
    """6 N' + 12 L d T (PaLM appendix B): N' excludes the embedding lookup, which does no matmul;
    the attention term counts QK^T and AV over the full (not causally halved) T x T."""
    n_matmul = n_params - cfg.vocab_size * cfg.d_model
    return 6.0 * n_matmul + 12.0 * cfg.n_layer * cfg.d_model * seq_len


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
