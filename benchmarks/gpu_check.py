"""The prepared GPU check (one GPU, about 8 minutes): throughput and MFU of pre_ln at the 400M
preset's widest shape first, then the GPU-only tests, pre_ln at the deepest shape and the step
time of every architecture relative to pre_ln there, written to one JSON file. Printed, never
asserted.

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json [--budget 4.1e8 --seq 2048 --batch 8]
    python benchmarks/gpu_check.py --smoke --out /tmp/gpu_check.json   # tiny sizes, CPU, seconds

Made to start and stop on time on a bare GPU machine:
- it imports the repository it sits in (its parent folder goes first on sys.path): no install;
- the JSON is rewritten atomically (depthbench.util.io) after every measurement, so whatever the
  machine's time allows is kept;
- a wall-clock budget (`--time-budget`, 480 s) is checked before each measurement: one that would
  not finish in what is left (estimated from the slowest measurement so far) is recorded as
  skipped; the GPU tests get what is left, at most `--tests-timeout`;
- each model is built, swapped and compiled exactly as training does it
  (depthbench.train.parallelize: the device's implementations from depthbench.kernels.swap, then
  `train.compile: block`, one compiled function for every checkpoint unit, the blocks or
  AttnRes's pre-normed sublayers), after `torch._dynamo.reset()`, so that one process compiling
  twelve models never hits dynamo's recompile limit (after which models silently run eager);
- the micro-batch is the largest, up to `--batch`, that the memory estimate
  (depthbench.train.memory, without activation checkpointing, 10 % headroom) fits on the device;
  an out-of-memory error is caught and recorded, and the next model goes on.

Before the throughput, the memory section (`--skip-memory` leaves it out): the CUDA allocator's
bytes of a training step against the memory estimate, every architecture (and MoE) in fp32 and
bf16 with the plain and the chunked loss, and with two micro-batches accumulated
(depthbench.train.measured_memory.allocator_step_memory).

After the GPU tests, AttnRes's depth mix alone at the deepest shape, its three implementations
(benchmarks/attnres_mix.py). Then pre_ln at the deepest shape, every other architecture there
(step time relative to pre_ln's), and, with the time left, every architecture at the widest
shape. `--record` writes
the step times as the committed record `benchmarks/records/<device>.json`
(depthbench.commands.step_records), which `depthbench plan` prices runs by.

Targets: pre_ln at >= 50% MFU at the widest shape on an H100/H200-class GPU; the deepest
shape within 1.3x of the widest shape's time per token; hc and mhc within 1.10x of pre_ln at
L = 70. Every measurement is bf16 autocast, fused AdamW, SDPA, the chunked loss of training
(train.loss_chunk_tokens' default), and per-block torch.compile on CUDA (`--no-compile` to turn it
off), timed after warm-up with a synchronize around each step.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository's depthbench, installed or not

import torch  # noqa: E402

from depthbench.commands.step_records import RECORDS, record_name  # noqa: E402
from depthbench.kernels.swap import swapped  # noqa: E402
from depthbench.models.config import ModelConfig  # noqa: E402
from depthbench.models.registry import build_model, registered_architectures  # noqa: E402
from depthbench.spec.shapes import solve_width  # noqa: E402
from depthbench.spec.training import TrainConfig  # noqa: E402
from depthbench.train.distributed import DistContext  # noqa: E402
from depthbench.train.flops import device_peak_flops, mfu, train_flops_per_token  # noqa: E402
from depthbench.train.measured_memory import allocator_step_memory  # noqa: E402
from depthbench.train.memory import HEADROOM, estimate_memory  # noqa: E402
from depthbench.train.parallelize import parallelize  # noqa: E402
from depthbench.util.io import atomic_write_json  # noqa: E402

ARCHS = ["pre_ln"] + [a for a in registered_architectures() if a != "pre_ln"]  # the reference first
GIB = 2**30
# The memory section: every architecture, and pre_ln and hc with MoE experts, at one moderate
# shape (a small vocabulary, so that the layers' activations and not the loss's dominate)
MEMORY_CASES = [(arch, {}) for arch in ARCHS] + [
    (arch, {"n_experts": 4, "top_k": 2}) for arch in ("pre_ln", "hc")
]
MEMORY_SHAPE = dict(vocab_size=8192, d_model=512, n_layer=8, n_head=8, max_seq_len=1024)
MEMORY_BATCH = 4
MEMORY_LOSS_CHUNK = 1024  # the chunked loss of training: 4 chunks of the micro-batch


def shape_config(arch: str, n_layer: int, args) -> ModelConfig:
    base = ModelConfig(arch=arch, vocab_size=args.vocab, n_head=args.n_head, max_seq_len=args.seq)
    s = solve_width(
        base,
        n_layer,
        args.budget,
        multiple=args.multiple,
        ff_multiple=args.multiple,
        tolerance=None,
    )  # d_ff at 8/3: the shapes of the recorded timings
    return ModelConfig(
        arch=arch,
        vocab_size=args.vocab,
        n_head=args.n_head,
        max_seq_len=args.seq,
        n_layer=s.n_layer,
        d_model=s.d_model,
        d_ff=s.d_ff,
    )


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def step_estimate(cfg: ModelConfig, batch: int, args, bf16: bool) -> float:
    """Estimated peak bytes of measure()'s step: one micro-batch of `batch` sequences, the
    chunked loss of training, no headroom."""
    return estimate_memory(
        cfg,
        batch,
        args.seq,
        bf16=bf16,
        loss_chunk_tokens=TrainConfig().loss_chunk_tokens,
        accumulating=False,
    ).total(False)


def fit_batch(cfg: ModelConfig, args, memory: int, bf16: bool) -> tuple[int, dict]:
    """The largest micro-batch <= args.batch whose estimated peak, with 10 % headroom, fits in
    `memory` bytes (0 when not even one sequence does), and the estimate behind it. The estimate
    grows with the batch about affinely (per-sequence activations and working sets, plus
    weights, gradients and AdamW): two estimates, at 1 and 2 sequences, give the first guess,
    which is then moved a sequence at a time, estimated each time, to the largest that fits
    (the largest term may change with the batch: the loss is plain while a micro-batch has
    fewer tokens than a loss chunk)."""
    one, two = (step_estimate(cfg, b, args, bf16) for b in (1, 2))
    per_sequence, fixed = two - one, 2 * one - two
    fits = (
        int((memory / (1 + HEADROOM) - fixed) // per_sequence) if per_sequence > 0 else args.batch
    )
    estimate = {1: one, 2: two}

    def fits_in(b: int) -> bool:
        if b not in estimate:
            estimate[b] = step_estimate(cfg, b, args, bf16)
        return estimate[b] * (1 + HEADROOM) <= memory

    batch = max(0, min(args.batch, fits))
    while batch > 0 and not fits_in(batch):
        batch -= 1
    while batch < args.batch and fits_in(batch + 1):
        batch += 1
    return batch, {
        "batch_requested": args.batch,
        "batch": batch,
        "device_gib": memory / GIB,
        "estimate_gib": estimate.get(max(batch, 1), one) / GIB,
    }


def measure(cfg: ModelConfig, args, device: torch.device, batch: int) -> dict:
    """Median seconds per optimizer step, tokens/s, MFU and peak memory of one model, built,
    swapped and compiled as training does (depthbench.train.parallelize)."""
    torch._dynamo.reset()  # a fresh cache per model: no recompile limit across models
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tc = TrainConfig(
        compile="block" if args.compile else "none",
        activation_checkpointing="none",
        kernels=args.kernels,
    )
    model.loss_chunk_tokens = tc.loss_chunk_tokens
    _, step_fn, _ = parallelize(model, tc, DistContext(), device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cuda", "cpu"))
    x = torch.randint(0, cfg.vocab_size, (batch, args.seq), device=device)

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = step_fn(x, x).loss
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
    tokens = batch * args.seq
    flops = train_flops_per_token(model, args.seq)
    return {
        "n_layer": cfg.n_layer,
        "d_model": cfg.d_model,
        "params": model.num_parameters(),
        "step_seconds": sec,
        "tokens_per_s": tokens / sec,
        "seconds_per_token": sec / tokens,
        "mfu": mfu(tokens / sec, flops, device_peak_flops(device, dtype), 1),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else None,
        # the implementations the swap put in (depthbench.kernels.swap): what was measured
        "implementations": sorted(set(swapped(model).values())),
    }


def sdpa_backends(cfg: ModelConfig, device: torch.device) -> dict:
    """Which of SDPA's CUDA backends run causal attention at `cfg`'s head dimension in bf16
    (flash attention needs a multiple of 8: the widest 400M shape has d 1216 over 16 heads, 76),
    and which one SDPA picks by itself (the profiler's kernel names)."""
    if device.type != "cuda":
        return {"skipped": "SDPA's CUDA backends: no CUDA device"}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hd = cfg.d_model // cfg.n_head
    q = torch.randn(1, cfg.n_head, 256, hd, device=device, dtype=torch.bfloat16)
    out: dict = {"head_dim": hd}
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out[backend.name] = "runs"
        except RuntimeError as exc:
            out[backend.name] = f"refused: {str(exc).splitlines()[0][:200]}"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "attention" in e.name.lower() or "fmha" in e.name]
    out["picked_kernels"] = sorted(set(names))[:5]
    return out


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def guarded(run, device: torch.device) -> dict:
    """run() -> its result, or {"error": ...}: out of memory (and any other failure) is recorded
    and the memory given back, so that one model cannot lose the others' numbers."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 (recorded, never raised)
        return {
            "error": "out of memory" if is_out_of_memory(exc) else "failed",
            "detail": repr(exc)[:500],
        }
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


class Report(dict):
    """The JSON report, written atomically after every entry, and the wall-clock budget."""

    def __init__(self, path: str, budget_s: float, **fields):
        super().__init__(fields)
        self.path, self.budget_s, self.t0, self.slowest = path, budget_s, time.monotonic(), 0.0

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def put(self, key: str, value) -> None:
        self[key] = value
        self["elapsed_s"] = round(time.monotonic() - self.t0, 3)
        atomic_write_json(self.path, self)

    def timed(self, work) -> dict:
        """work() -> dict with its wall seconds, or a skip record when the budget cannot hold it
        (estimated as the slowest measurement so far)."""
        if self.left() < self.slowest:
            return {
                "skipped": f"wall-clock budget: {self.left():.0f} s left, "
                f"about {self.slowest:.0f} s needed"
            }
        t = time.monotonic()
        result = work()
        result["wall_s"] = round(time.monotonic() - t, 3)
        self.slowest = max(self.slowest, result["wall_s"])
        return result


def run_model(report: Report, arch: str, n_layer: int, args, device: torch.device) -> dict:
    cfg = shape_config(arch, n_layer, args)

    def work() -> dict:
        batch, memory = fit_batch(cfg, args, device_memory(device), bf16=device.type == "cuda")
        if batch == 0:
            return {"error": "out of memory (estimate)", "memory": memory}
        return {**guarded(lambda: measure(cfg, args, device, batch), device), "memory": memory}

    return report.timed(lambda: guarded(work, device))


def memory_against_estimate(report: Report, device: torch.device) -> dict:
    """The CUDA allocator's bytes of a training step
    (depthbench.train.measured_memory.allocator_step_memory) against
    depthbench.train.memory.estimate_memory, per case of MEMORY_CASES in fp32 and under
    bf16 autocast, with the plain loss and the chunked one (MEMORY_LOSS_CHUNK tokens): each term
    measured, estimated and their ratio (estimate / measured). tests/integration/test_gpu.py
    holds the same comparison to its tolerances."""
    if device.type != "cuda":
        return {"skipped": "the CUDA allocator is measured: no CUDA device"}
    rows: dict = {}
    seq = MEMORY_SHAPE["max_seq_len"]
    # one step first, unrecorded: CUDA's one-time allocations (cuBLAS workspaces, about 70 MiB on
    # an H200) would otherwise count in the first case's step
    allocator_step_memory(ModelConfig(arch=ARCHS[0], **MEMORY_SHAPE), 1, seq, False, device)
    for arch, moe in MEMORY_CASES:
        cfg = ModelConfig(arch=arch, moe=moe, **MEMORY_SHAPE)
        for bf16 in (False, True):
            # the plain and the chunked loss; with the chunked one also a step accumulating two
            # micro-batches (key ...-accumulated), as every GPU preset's runs do
            for chunk, micro_batches in ((0, 1), (MEMORY_LOSS_CHUNK, 1), (MEMORY_LOSS_CHUNK, 2)):
                key = "-".join(
                    [arch]
                    + (["moe"] if moe else [])
                    + ["bf16" if bf16 else "fp32", "chunked" if chunk else "plain"]
                    + (["accumulated"] if micro_batches > 1 else [])
                )

                def work(cfg=cfg, bf16=bf16, chunk=chunk, micro_batches=micro_batches) -> dict:
                    got = allocator_step_memory(
                        cfg,
                        MEMORY_BATCH,
                        seq,
                        bf16,
                        device,
                        loss_chunk_tokens=chunk,
                        micro_batches=micro_batches,
                    )
                    est = estimate_memory(
                        cfg,
                        MEMORY_BATCH,
                        seq,
                        bf16=bf16,
                        device="cuda",
                        loss_chunk_tokens=chunk,
                        accumulating=micro_batches > 1,
                    )
                    return {
                        term: {
                            "measured": measured,
                            "estimate": estimated,
                            "ratio": estimated / measured if measured else None,
                        }
                        for term, measured, estimated in (
                            ("static", got.static, est.weights + est.optimizer),
                            ("saved", got.saved, est.activations),
                            ("peak", got.peak, est.total("none")),
                        )
                    }

                rows[key] = report.timed(lambda work=work: guarded(work, device))
                ratios = {t: r.get("ratio") for t, r in rows[key].items() if isinstance(r, dict)}
                print(key, ratios, flush=True)
                report.put("memory_vs_estimate", rows)
    return rows


def gpu_tests(report: Report, args) -> dict:
    """tests/integration/test_gpu.py in a subprocess with what is left of the budget (at most
    --tests-timeout)."""
    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest is not installed"}
    timeout = min(args.tests_timeout, report.left() - report.slowest)
    if timeout < 10:
        return {"skipped": f"wall-clock budget: {report.left():.0f} s left"}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-o",
                "addopts=-ra",
                "-p",
                "no:cacheprovider",
                "-m",
                "gpu",
                "tests/integration/test_gpu.py",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        return {
            "returncode": None,
            "timeout_s": timeout,
            "tail": (exc.stdout or b"")[-2000:].decode(errors="replace"),
        }
    print(done.stdout[-2000:], flush=True)
    return {"returncode": done.returncode, "tail": done.stdout[-2000:]}


def attnres_mix(report: Report, args, device: torch.device) -> dict:
    """AttnRes's depth mix alone at the deepest shape (benchmarks/attnres_mix.py): the
    definition, the grouped mix with PyTorch products and with Triton products (on CUDA), their
    times relative to the definition's. Tiny on the CPU, without the interpreted Triton."""
    spec = importlib.util.spec_from_file_location("attnres_mix", REPO / "benchmarks/attnres_mix.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = shape_config("attnres_full", args.deepest, args)
    if device.type == "cuda":
        tokens = args.batch * args.seq
        argv = ["--n-layer", str(cfg.n_layer), "--d", str(cfg.d_model), "--tokens", str(tokens)]
    else:
        argv = ["--n-layer", "2", "--d", "32", "--tokens", "16", "--dtype", "float32"]
    return report.timed(lambda: guarded(lambda: bench.main([*argv, "--repeats", "3"]), device))


def record_runs(report: Report) -> list[dict]:
    """The measured runs of the report, one per architecture and depth."""
    runs = []
    entries = [("pre_ln", report.get("pre_ln_widest")), ("pre_ln", report.get("pre_ln_deepest"))]
    for key in ("arch_ratios_deepest", "arch_ratios_widest"):
        entries += list(report.get(key, {}).items())
    for arch, r in entries:
        if not isinstance(r, dict) or "step_seconds" not in r:
            continue
        runs.append(
            {
                "arch": arch,
                "n_layer": r["n_layer"],
                "d_model": r["d_model"],
                "micro_batch": r["memory"]["batch"],
                "tokens_per_s": round(r["tokens_per_s"], 1),
                "mfu": round(r["mfu"], 4),
                "step_time_vs_pre_ln": 1.0 if arch == "pre_ln" else r["step_time_vs_pre_ln"],
                "peak_memory_bytes": r["peak_memory_bytes"],
            }
        )
    return runs


def git_commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    commit = done.stdout.strip() or "unknown"
    return commit + ("+changes" if dirty.stdout.strip() else "")


def write_record(report: Report, args) -> None:
    """The record for depthbench plan (depthbench.commands.step_records), rewritten atomically
    as the measurements come; only with --record."""
    if not args.record:
        return
    path = RECORDS / record_name(report["device"]) if args.record == "auto" else Path(args.record)
    atomic_write_json(
        path,
        {
            "what": "Training-step times on one GPU (benchmarks/gpu_check.py): per architecture "
            "and depth, tokens/s, MFU and the step time over pre_ln's at the same depth, "
            "parameter budget, micro-batch and sequence length, measured in the same process.",
            "device": report["device"],
            "torch": torch.__version__,
            "commit": report["commit"],
            "recorded": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
            "settings": {
                "budget": args.budget,
                "seq_len": args.seq,
                "vocab_size": args.vocab,
                "dtype": "bfloat16 autocast" if args.device == "cuda" else "float32",
                "compile": "block" if args.compile else "none",
                "kernels": args.kernels,
            },
            "runs": record_runs(report),
        },
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
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
    p.add_argument(
        "--time-budget", type=float, default=480.0, help="wall-clock seconds for the whole check"
    )
    p.add_argument("--tests-timeout", type=float, default=150.0)
    p.add_argument(
        "--kernels",
        choices=["auto", "reference"],
        default="auto",
        help="train.kernels: the device's fast implementations (auto) or the definitions",
    )
    p.add_argument(
        "--record",
        nargs="?",
        const="auto",
        help="write the step times as a record for depthbench plan (default path: "
        "benchmarks/records/<device>.json)",
    )
    p.add_argument("--compile", dest="compile", action="store_true", default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: torch's; 1 with --smoke)"
    )
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument(
        "--archs",
        nargs="+",
        choices=ARCHS[1:],
        help="the architectures timed against pre_ln (default: every one)",
    )
    p.add_argument("--skip-memory", action="store_true", help="no memory-vs-estimate section")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes on the CPU: exercises the whole script in seconds",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.budget, args.vocab, args.n_head, args.multiple = 2e5, 256, 2, 16
        args.widest, args.deepest, args.seq, args.batch, args.warmup, args.steps = 2, 4, 32, 2, 1, 2
        args.device = "cpu" if args.device == "auto" else args.device
        args.threads = args.threads or 1  # tiny models: threads only contend (a shared CI machine)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.compile is None:  # compile where it pays: CUDA, full sizes
        args.compile = args.device == "cuda" and not args.smoke
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    import depthbench

    report = Report(
        args.out,
        args.time_budget,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        commit=git_commit(),
        depthbench=str(Path(depthbench.__file__).resolve().parent),
        config=vars(args),
    )
    if not args.skip_memory:
        report.put("memory_vs_estimate", memory_against_estimate(report, device))
    report.put(
        "sdpa_backends_widest",
        guarded(lambda: sdpa_backends(shape_config("pre_ln", args.widest, args), device), device),
    )
    report.put("pre_ln_widest", run_model(report, "pre_ln", args.widest, args, device))
    if not args.skip_tests:
        report.put("gpu_tests", gpu_tests(report, args))
    report.put("attnres_mix_deepest", attnres_mix(report, args, device))
    deepest = run_model(report, "pre_ln", args.deepest, args, device)
    report.put("pre_ln_deepest", deepest)
    widest = report["pre_ln_widest"]
    if "seconds_per_token" in widest and "seconds_per_token" in deepest:
        report.put(
            "deepest_vs_widest_time_per_token",
            deepest["seconds_per_token"] / widest["seconds_per_token"],
        )
    ratios: dict = {}
    for arch in args.archs or ARCHS[1:]:  # at the deepest shape, where the residual path matters
        r = run_model(report, arch, args.deepest, args, device)
        if "step_seconds" in r and "step_seconds" in deepest:
            r = {"step_time_vs_pre_ln": r["step_seconds"] / deepest["step_seconds"], **r}
        ratios[arch] = r
        print(arch, r.get("step_time_vs_pre_ln", r.get("error", r.get("skipped"))), flush=True)
        report.put("arch_ratios_deepest", ratios)
        write_record(report, args)
    widest_ratios: dict = {}
    for arch in args.archs or ARCHS[1:]:  # with the time left, the widest shape too
        r = run_model(report, arch, args.widest, args, device)
        if "step_seconds" in r and "step_seconds" in widest:
            r = {"step_time_vs_pre_ln": r["step_seconds"] / widest["step_seconds"], **r}
        widest_ratios[arch] = r
        report.put("arch_ratios_widest", widest_ratios)
        write_record(report, args)
    report.put("finished", True)
    print(f"wrote {args.out} in {report['elapsed_s']:.1f} s")


if __name__ == "__main__":
    main()
