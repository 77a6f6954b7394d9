"""Wall time of the whole probe stage of one 32-layer model at the CPU preset's scale.

The target: probing a 32-layer model of the CPU preset (config/presets/cpu_all.yaml:
0.8M parameters, vocab 2048, 4 heads, 16 sequences of 128 tokens) takes at most 2 minutes on
2 cores. Each architecture is timed through `probe_model` exactly as the probe stage runs it:
the init-stage probes plus the full trained-stage set (angular distances, causal scores in
L + 1 passes, permutation scores for every layer pair, usefulness, effective rank, ...), on
random weights (probe cost does not depend on the values).

    .venv/bin/python benchmarks/probe_time.py [--threads 2 --n-layer 32 --archs pre_ln hc ...]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from depthbench.models.config import ModelConfig
from depthbench.models.registry import build_model, registered_architectures
from depthbench.probes.measure import probe_model
from depthbench.probes.run import probe_settings
from depthbench.spec.shapes import solve_width

ARCHS = registered_architectures()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=32)
    p.add_argument("--budget", type=float, default=8e5)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--n-sequences", type=int, default=16)
    p.add_argument("--archs", nargs="*", default=ARCHS)
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for arch in args.archs:
        base = ModelConfig(arch=arch, vocab_size=args.vocab, n_head=4, max_seq_len=args.seq)
        s = solve_width(
            base, args.n_layer, args.budget, multiple=16, ff_multiple=32, tolerance=None
        )  # d_ff at 8/3: the shapes of the recorded timings
        torch.manual_seed(0)
        model = build_model(
            ModelConfig(
                arch=arch,
                vocab_size=args.vocab,
                n_head=4,
                max_seq_len=args.seq,
                n_layer=s.n_layer,
                d_model=s.d_model,
                d_ff=s.d_ff,
            )
        ).eval()
        idx = torch.randint(0, args.vocab, (args.n_sequences, args.seq + 1))
        t = time.perf_counter()
        settings = probe_settings(
            {"threads": args.threads}
        )  # as the probe stage runs with `threads: 2`
        rows = probe_model(model, idx, "init", settings, full=False)
        rows += probe_model(model, idx, "trained", settings, full=True)
        seconds = time.perf_counter() - t
        results[arch] = {"d_model": s.d_model, "seconds": round(seconds, 2), "rows": len(rows)}
        print(
            f"{arch:<14} L={s.n_layer} d={s.d_model:<4} {seconds:6.1f} s  ({len(rows)} rows)",
            flush=True,
        )
    worst = max(r["seconds"] for r in results.values())
    print(f"slowest: {worst:.1f} s on {args.threads} threads (target <= 120 s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
