"""Ways to mix n residual streams with per-token matrices, (M H)_j = sum_i M_ji H_i, forward
and forward + backward, timed in one process (what hc and mhc do twice per sublayer).

    .venv/bin/python benchmarks/stream_mix.py [--d 64 --tokens 2048 --n 4 --threads 2]

Prints milliseconds per call and the ratio to the batched matmul that `mix_matrix` uses.
"""

from __future__ import annotations

import argparse
import time

import torch

from depthbench.models.streams import mix_matrix


def multiply_adds(M: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """n multiply-adds of whole streams (the previous implementation)."""
    columns = M.movedim(-1, 0).contiguous().unsqueeze(-1)
    out = columns[0] * H[..., 0, None, :]
    for i in range(1, H.shape[-2]):
        out = torch.addcmul(out, columns[i], H[..., i, None, :])
    return out


def broadcast(M: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    return (M.unsqueeze(-1) * H.unsqueeze(-3)).sum(-2)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n, d = args.n, args.d
    H0 = torch.randn(args.tokens, 1, n, d)
    M0 = torch.randn(args.tokens, 1, n + 1, n)
    grad = torch.randn(args.tokens, 1, n + 1, d)
    results = {}
    for name, fn in [
        ("batched matmul (mix_matrix)", mix_matrix),
        ("n multiply-adds", multiply_adds),
        ("broadcast product", broadcast),
    ]:
        M, H = M0.clone().requires_grad_(), H0.clone().requires_grad_()
        for _ in range(5):
            fn(M, H).backward(grad)
        t = time.perf_counter()
        for _ in range(args.repeats):
            fn(M, H).backward(grad)
        both = (time.perf_counter() - t) / args.repeats
        with torch.no_grad():
            t = time.perf_counter()
            for _ in range(args.repeats):
                fn(M, H)
            forward = (time.perf_counter() - t) / args.repeats
        results[name] = (forward, both)
    ref = results["batched matmul (mix_matrix)"]
    print(f"{args.tokens} tokens, n = {n}, d = {d}, threads {args.threads}")
    print(f"{'method':30s} {'fwd ms':>8s} {'ratio':>6s} {'fwd+bwd ms':>11s} {'ratio':>6s}")
    for name, (f, b) in results.items():
        print(f"{name:30s} {f * 1e3:8.3f} {f / ref[0]:5.2f}x {b * 1e3:11.3f} {b / ref[1]:5.2f}x")


if __name__ == "__main__":
    main()
