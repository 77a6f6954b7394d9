"""The prepared GPU check (one GPU, about 8 minutes): GPU-only tests, then throughput of pre_ln at
the 400M preset's widest and deepest shapes and the step time of every architecture relative to
pre_ln at the deepest shape, written to one JSON file. Printed, never asserted.

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json [--budget 4.1e8 --seq 2048 --batch 8]

Targets (issue 6): pre_ln at >= 45% MFU at the widest shape on an H100/H200-class GPU; the deepest
shape within 1.3x of the widest shape's time per token; hc, mhc, attnres_full and moda within 1.3x
of pre_ln. Every measurement is bf16 autocast, fused AdamW, SDPA, and torch.compile when
--compile is given (the default on CUDA), timed with CUDA events after warm-up.
`--smoke` shrinks everything so that the script itself can be tested on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from depthbench.models import ModelConfig, build_model, registered_architectures
from depthbench.shapes import solve_width
from depthbench.train.flops import device_peak_flops, mfu, train_flops_per_token

ARCHS = ["pre_ln"] + [a for a in registered_architectures() if a != "pre_ln"]  # the reference first


def shape_config(arch: str, n_layer: int, args) -> ModelConfig:
    base = ModelConfig(arch=arch, vocab_size=args.vocab, n_head=args.n_head, max_seq_len=args.seq)
    s = solve_width(base, n_layer, args.budget, multiple=args.multiple, ff_multiple=args.multiple, tolerance=None)  # d_ff at 8/3: the shapes of the recorded timings
    return ModelConfig(arch=arch, vocab_size=args.vocab, n_head=args.n_head, max_seq_len=args.seq,
                       n_layer=s.n_layer, d_model=s.d_model, d_ff=s.d_ff)


def measure(cfg: ModelConfig, args, device: torch.device) -> dict:
    """Median seconds per optimizer step, tokens/s, MFU and peak memory of one model."""
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    fn = torch.compile(model) if args.compile else model
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = fn(x, x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    sec = statistics.median(times)
    tokens = args.batch * args.seq
    flops = train_flops_per_token(model, args.seq)
    peak = device_peak_flops(device, dtype)
    result = {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "params": model.num_parameters(), "step_seconds": sec,
              "tokens_per_s": tokens / sec, "seconds_per_token": sec / tokens, "mfu": mfu(tokens / sec, flops, peak, 1),
              "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    del model, opt, fn
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    p.add_argument("--budget", type=float, default=4.1e8)
    p.add_argument("--vocab", type=int, default=50280)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--multiple", type=int, default=64)
    p.add_argument("--widest", type=int, default=16)
    p.add_argument("--deepest", type=int, default=70)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: exercise the script on CPU")
    args = p.parse_args()
    if args.smoke:
        args.budget, args.vocab, args.n_head, args.multiple = 2e5, 256, 2, 16
        args.widest, args.deepest, args.seq, args.batch, args.warmup, args.steps, args.compile = 2, 4, 32, 2, 1, 2, False
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                    "config": vars(args)}
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    if not args.skip_tests:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"], capture_output=True, text=True)
        report["gpu_tests"] = {"returncode": done.returncode, "tail": done.stdout[-2000:]}
        print(done.stdout[-2000:], flush=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    report["pre_ln_widest"] = measure(shape_config("pre_ln", args.widest, args), args, device)
    save()
    report["pre_ln_deepest"] = measure(shape_config("pre_ln", args.deepest, args), args, device)
    report["deepest_vs_widest_time_per_token"] = report["pre_ln_deepest"]["seconds_per_token"] / report["pre_ln_widest"]["seconds_per_token"]
    save()
    print(json.dumps({k: report[k] for k in ("pre_ln_widest", "pre_ln_deepest", "deepest_vs_widest_time_per_token")}, indent=1), flush=True)
    ratios = {}
    for arch in ARCHS[1:]:  # at the deepest shape, where the residual path matters most
        try:
            r = measure(shape_config(arch, args.deepest, args), args, device)
            ratios[arch] = {"step_time_vs_pre_ln": r["step_seconds"] / report["pre_ln_deepest"]["step_seconds"], **r}
        except Exception as exc:  # one architecture failing must not lose the others' numbers
            ratios[arch] = {"error": repr(exc)}
        print(arch, ratios[arch].get("step_time_vs_pre_ln", ratios[arch].get("error")), flush=True)
        report["arch_ratios_deepest"] = ratios
        save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
