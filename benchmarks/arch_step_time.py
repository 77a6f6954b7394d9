"""Training step time of every architecture relative to pre_ln at the same parameter count.

For each architecture the shape solver picks the width that meets the same budget at the same
depth (extra parameters of an architecture are charged to it, so its width may be smaller).
All models live in one process and are timed in pairs: each round times `--steps` steps of
pre_ln, then the same number of the architecture, for every architecture in turn; an
architecture's ratio is the median over rounds of its time divided by the pre_ln time measured
just before it. (Pairing cancels the slow drifts of a shared machine's speed, which moved
separately-timed medians by up to 20%.) The step times shown are medians too. Target on CPU: at
most 1.5x for hc, mhc, attnres_full, attnres_block and moda.

    .venv/bin/python benchmarks/arch_step_time.py [--budget 8e5 --n-layer 8 --vocab 2048
        --batch 16 --seq 128 --threads 2 --rounds 7 --steps 1 --json out.json]

Every model runs the CPU's implementations that training swaps in (depthbench.kernels.swap: the
C++ kernels of HC's and mHC's reads and writes where they build, MoDA's fused attention); the
header says whether the C++ kernels built. The optimizer is the training loop's (fused AdamW).

An entry of --archs may carry arch_options and `kernels` (`reference`: the definition as written;
`cuda`: the CUDA backend's implementations, on CPU tensors), e.g. `--archs moda
moda:kernels=reference attnres_full:kernels=cuda`, to time an implementation against the
default in the same run.

--compile wraps every model in torch.compile, as `train.compile: model` does in a run, and also
reports each model's compile time (its first step): on CPU, inductor fuses the element-wise
stream and depth mixing that eager mode runs as separate kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import yaml

from depthbench import kernels
from depthbench.kernels.swap import swap_in
from depthbench.models.registry import ARCHITECTURES, build_model, canonical_arch
from depthbench.models.config import ModelConfig
from depthbench.spec.shapes import solve_width
from depthbench.train.recipe import build_optimizer


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--budget", type=float, default=8e5)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--multiple", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument(
        "--archs",
        nargs="*",
        default=None,
        help="architectures, each optionally with arch_options and kernels: moda:kernels=reference",
    )
    p.add_argument(
        "--compile", action="store_true", help="torch.compile every model (train.compile: model)"
    )
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    canonical_arch("pre_ln")
    others = [parse_spec(a) for a in args.archs or sorted(ARCHITECTURES)]
    archs = ["pre_ln"] + [a for a in others if a != "pre_ln"]  # the reference first

    steps, info = {}, {}
    x = torch.randint(0, args.vocab, (args.batch, args.seq))
    y = torch.randint(0, args.vocab, (args.batch, args.seq))
    for label in archs:
        arch, _, spec = label.partition(":")
        options = (
            {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in spec.split(","))}
            if spec
            else {}
        )
        implementation = options.pop("kernels", "auto")
        base = ModelConfig(
            arch=arch,
            vocab_size=args.vocab,
            n_head=args.n_head,
            max_seq_len=args.seq,
            arch_options=options,
        )
        shape = solve_width(
            base, args.n_layer, args.budget, multiple=args.multiple, ff_multiple=32, tolerance=None
        )  # d_ff at 8/3: the shapes of the recorded timings
        torch.manual_seed(0)
        model = build_model(
            ModelConfig(
                arch=arch,
                vocab_size=args.vocab,
                n_head=args.n_head,
                max_seq_len=args.seq,
                n_layer=shape.n_layer,
                d_model=shape.d_model,
                d_ff=shape.d_ff,
                arch_options=options,
            )
        )
        if implementation == "cuda":
            swap_in(model, "cuda")
        else:
            swap_in(model, "cpu", implementation)
        opt = build_optimizer(
            model, 1e-4, 0.1, (0.9, 0.95), 1e-8, torch.device("cpu")
        )  # as training does

        net = torch.compile(model) if args.compile else model

        def step(net=net, opt=opt):
            out = net(x, y)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t = time.perf_counter()
        step()  # warm-up; with --compile, the compilation
        first = time.perf_counter() - t
        steps[label] = step
        info[label] = {
            "d_model": shape.d_model,
            "n_layer": shape.n_layer,
            "params": shape.n_params,
            "first_step_seconds": first,
        }

    def timed(arch: str) -> float:
        t = time.perf_counter()
        for _ in range(args.steps):
            steps[arch]()
        return (time.perf_counter() - t) / args.steps

    times: dict[str, list[float]] = {a: [] for a in archs}
    ratios: dict[str, list[float]] = {a: [] for a in archs}
    for _ in range(args.rounds):
        for arch in archs:
            if arch == "pre_ln":
                continue
            reference = timed("pre_ln")  # the pair: pre_ln, then the architecture
            elapsed = timed(arch)
            times["pre_ln"].append(reference)
            times[arch].append(elapsed)
            ratios[arch].append(elapsed / reference)
        if archs == ["pre_ln"]:
            times["pre_ln"].append(timed("pre_ln"))
    ratios["pre_ln"] = [1.0]
    print(
        f"budget {args.budget:,.0f} params, L={args.n_layer}, batch {args.batch}x{args.seq}, "
        f"vocab {args.vocab}, "
        f"threads {args.threads}, {'torch.compile' if args.compile else 'eager'}, "
        f"CPU kernels {'on' if kernels.cpu_kernels() is not None else 'off'}"
    )
    width = max(14, *map(len, archs))
    print(
        f"{'arch':<{width}} {'d_model':>7} {'params':>10} {'step ms':>9} {'vs pre_ln':>9} "
        f"{'first step s':>12}"
    )
    for arch in archs:
        med, ratio = statistics.median(times[arch]), statistics.median(ratios[arch])
        info[arch].update(step_seconds=med, ratio_to_pre_ln=ratio, ratios=ratios[arch])
        print(
            f"{arch:<{width}} {info[arch]['d_model']:>7} {info[arch]['params']:>10,} "
            f"{1000 * med:>9.1f} {ratio:>8.2f}x"
            f" {info[arch]['first_step_seconds']:>12.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": vars(args),
                    "cpu_kernels": kernels.cpu_kernels() is not None,
                    "results": info,
                },
                f,
                indent=2,
            )


def parse_spec(spec: str) -> str:
    """'arch' or 'arch:key=value,...' with the architecture's canonical name; the options must be
    key=value pairs, each value read as YAML (n_blocks=2 is an integer), as in a config file."""
    arch, sep, options = spec.partition(":")
    if sep and not all("=" in item for item in options.split(",")):
        raise SystemExit(f"--archs {spec!r}: options must be key=value pairs separated by commas")
    return canonical_arch(arch) + sep + options


if __name__ == "__main__":
    main()
