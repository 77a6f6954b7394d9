"""Full AttnRes's depth mix alone, forward + backward over all 2L + 1 readers, timed in one
process for its three implementations: the definition (one multiply-add per source and reader,
depthbench.models.archs.attnres_sources), the grouped two-phase mix with PyTorch products and
the same with Triton products (depthbench.kernels.attnres_groups, attnres_triton). The sublayers
are left out: random outputs stand in for them, v_0 in float32 and the outputs in --dtype, as
under bf16 autocast.

    python benchmarks/attnres_mix.py                   # a GPU: L = 70, d 640, 16,384 tokens, bf16
    python benchmarks/attnres_mix.py --smoke           # the CPU, tiny sizes, Triton interpreted

On a CPU without --smoke the Triton products are left out (the interpreter's time means nothing).

Prints milliseconds per forward + backward (median of --repeats), each implementation's ratio to
the definition, and the largest relative difference of its readers' mixes and of the sources'
gradients from the definition's. Printed, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository's depthbench, installed or not


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n-layer", type=int, default=70)
    p.add_argument("--d", type=int, default=640)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (interpreter)")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
        args.n_layer, args.d, args.tokens, args.dtype, args.repeats = 3, 72, 40, "float32", 2

    import torch

    from depthbench.kernels import attnres_groups as ag
    from depthbench.kernels import triton_streams as ts
    from depthbench.models.archs.attnres_sources import DepthSources

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device).manual_seed(0)
    L, d, N = args.n_layer, args.d, args.tokens
    R = 2 * L + 1
    v0 = torch.randn(1, N, d, device=device, generator=g).requires_grad_()
    outputs = [
        torch.randn(1, N, d, device=device, generator=g).to(dtype).requires_grad_()
        for _ in range(R - 1)
    ]
    queries = (0.1 * torch.randn(d, R, device=device, generator=g)).requires_grad_()
    up = [torch.randn(1, N, d, device=device, generator=g).to(dtype) for _ in range(R)]

    def definition():
        return DepthSources(v0, queries, 1e-6)

    def grouped(kernels):
        return lambda: ag.GroupedDepthSources(v0, queries, 1e-6, capacity=R - 1, kernels=kernels)

    variants = [("definition", definition), ("grouped, PyTorch products", grouped(ag.TORCH))]
    triton = importlib.util.find_spec("triton") is not None
    if triton and (cuda or args.smoke):  # on the CPU only interpreted: its time means nothing
        from depthbench.kernels import attnres_triton as at

        variants.append(("grouped, Triton products", grouped(at.KERNELS)))

    def step(make):
        sources, hs = make(), []
        for r in range(R):
            h, _ = sources.current()
            hs.append(h.to(dtype))
            if r < R - 1:
                sources.add(outputs[r], r // 2 + 1, r % 2 == 1)
        grads = torch.autograd.grad(hs, [v0, *outputs, queries], up)
        return hs, grads

    def sync():
        if cuda:
            torch.cuda.synchronize()

    results, reference = {}, None
    print(f"{device}, L = {L} ({R} readers), d {d}, {N} tokens, outputs in {args.dtype}")
    with ts.on_cpu() if args.smoke else contextlib.nullcontext():
        for name, make in variants:
            hs, grads = step(make)  # warm-up (Triton compiles here)
            sync()
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                step(make)
                sync()
                times.append(time.perf_counter() - t)
            ms = 1e3 * statistics.median(times)
            if reference is None:
                reference = (hs, grads, ms)
            diff = max(
                _rel(a, b) for a, b in zip(hs + list(grads), reference[0] + list(reference[1]))
            )
            results[name] = {"ms": ms, "ratio": ms / reference[2], "max_rel_diff": diff}
            print(f"  {name:28s} {ms:9.2f} ms  {ms / reference[2]:5.2f}x  max rel diff {diff:.1e}")
    return results


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


if __name__ == "__main__":
    main()
