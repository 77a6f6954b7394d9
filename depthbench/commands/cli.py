"""Command line: `depthbench shapes CONFIG` prints the resolved shape table; `depthbench runs
CONFIG` lists the run ids of the grid; `depthbench validate CONFIG` checks a config;
`depthbench regenerate [CONFIG]` rebuilds every table, figure and the HTML report from the run
outputs under results/ without training, probing or scoring anything; `depthbench status
[CONFIG]` tells, per run, what is done, missing or stale and what snakemake would do next;
`depthbench rehearse CONFIG` builds, steps, checkpoints, resumes and probes each architecture's
widest and deepest shape at full size (depthbench.commands.rehearse.rehearsal)."""

from __future__ import annotations

import argparse
import os
import sys

from depthbench.grid.config import expand_grid, shape_table
from depthbench.spec.schema import load_config
from depthbench.util.errors import DepthBenchError


def _experiment(path: str):
    return expand_grid(load_config(path))


def cmd_shapes(args) -> None:
    exp = _experiment(args.config)
    rows = shape_table(exp)
    budget = exp.config.get("budget", {}).get("params")
    header = f"{'arch':<12} {'L':>4} {'d_model':>8} {'ratio':>7} {'d_ff':>6} {'heads':>6} {'kv':>4} {'params':>15}"
    if budget:  # relative, as in runs.parquet: -0.0031 is 0.31% under budget.params
        header += f" {'params_vs_budget':>17}"
    print(header)
    for r in rows:
        line = (
            f"{r['arch']:<12} {r['n_layer']:>4} {r['d_model']:>8} {r['ratio']:>7.1f} {r['d_ff']:>6} "
            f"{r['n_head']:>6} {r['n_kv_head']:>4} {r['params']:>15,}"
        )
        if budget:
            line += f" {r['params_vs_budget']:>+17.4f}"
        extra = {k: v for k, v in r.items() if k.startswith("knob:")}
        print(line + (f"  {extra}" if extra else ""))


def cmd_runs(args) -> None:
    exp = _experiment(args.config)
    for run_id, spec in exp.runs.items():
        print(
            run_id,
            f"steps={spec.train.total_steps}",
            f"tokens={spec.train.total_steps * spec.train.tokens_per_step:,}",
        )


def cmd_validate(args) -> None:
    from depthbench.grid.config import ignored_settings

    exp = _experiment(args.config)
    print(
        f"{args.config}: valid; {len(exp.runs)} runs, data {exp.data_id}, tokenizer {exp.tokenizer_id}"
    )
    for line in ignored_settings(exp.config):
        print(f"  ignored (no architecture of the grid reads it): {line}")


def cmd_plan(args) -> None:
    from depthbench.commands.plan import format_plan, plan_experiment

    exp = _experiment(args.config)
    plans = plan_experiment(exp, mfu=args.mfu, peak=args.peak, gpu_memory=args.gpu_memory_gb * 1e9)
    print(format_plan(plans, args.gpu, args.mfu, args.gpu_memory_gb * 1e9))


def cmd_rehearse(args) -> int:
    """Widest and deepest shape of every architecture at full size on this machine (see
    depthbench.commands.rehearse.rehearsal); exit status 1 when a shape failed or was refused."""
    import torch

    from depthbench.commands.rehearse.command import format_report, rehearse_experiment

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    exp = _experiment(args.config)
    archs = args.archs.split(",") if args.archs else None
    report = rehearse_experiment(
        exp,
        args.out,
        mode="meta" if args.meta else args.mode,
        archs=archs,
        which=tuple(args.shapes.split(",")),
        tokens=args.tokens,
        probe_tokens=args.probe_tokens,
        probe_passes=args.probe_passes,
        gpu_memory=args.gpu_memory_gb * 1e9,
        config_path=args.config,
    )
    print(format_report(report))
    return int(any(r.get("status") != "ok" for r in report["rows"]))


# The rules that only read results/: everything else (tokenize, train, probe, nll) is not allowed.
REGENERATE_RULES = [
    "tables",
    "cost_table",
    "probes_table",
    "nll_table",
    "removal_table",
    "figures",
    "probe_figures",
    "dynamics_figure",
    "nll_figures",
    "cost_figures",
    "claims",
    "report",
    "all",
]


def regenerate_commands(config: str | None, cores: int, provenance: str) -> list[list[str]]:
    """The two Snakemake calls: rebuild tables, figures, claims and results/report.html from run
    outputs, then Snakemake's own provenance report (rules, code, logs) at `provenance`."""
    base = [sys.executable, "-m", "snakemake", "--cores", str(cores)]
    if config:
        base += ["--configfile", config]
    rebuild = base + [
        "--allowed-rules",
        *REGENERATE_RULES,
        "--forcerun",
        *[r for r in REGENERATE_RULES if r != "all"],
        "--rerun-triggers",
        "mtime",
    ]
    return [rebuild, base + ["--report", provenance]]


def cmd_regenerate(args) -> None:
    import subprocess

    if args.config:
        _experiment(args.config)  # a bad config fails here, naming the field
    for command in regenerate_commands(args.config, args.cores, args.provenance):
        print("+", " ".join(command), file=sys.stderr)
        done = subprocess.run(command)
        if done.returncode:
            raise SystemExit(
                f"depthbench regenerate: snakemake exited with {done.returncode}. If it names a missing "
                "file under results/runs, results/probes, results/nll or results/removal, that run's outputs were not "
                "copied: regenerate never trains, probes or scores."
            )
    print(
        f"tables in results/tables, figures in results/figures, report in results/report.html, provenance in {args.provenance}",
        file=sys.stderr,
    )


def cmd_status(args) -> None:
    """Per run: trained / diverged / probed / scored / missing / stale, and the next snakemake
    run's jobs, from the files under results/ (nothing is run; see depthbench.commands.status)."""
    from depthbench.commands.status import format_status

    print(format_status(_experiment(args.config), args.results))


def cmd_checksum(args) -> None:
    """Record the SHA-256 of an unchecked run's final weights in its summary.json (depthbench.train.runcheck)."""
    from depthbench.train.runcheck import record_checksum

    for run_dir in args.run_dirs:
        print(f"{run_dir}: weights_sha256 {record_checksum(run_dir)}")


def cmd_rename_runs(args) -> None:
    """Move results trained under whole-section option hashing to today's run ids (depthbench.commands.rename)."""
    from depthbench.commands.rename import format_plan, rename_runs

    plan = rename_runs(_experiment(args.config), args.results, dry_run=args.dry_run)
    print(format_plan(plan, args.dry_run))


def cmd_export(args) -> None:
    from depthbench.hf.export import export_run

    info = export_run(
        args.run_dir, args.out_dir, results_dir=args.results, overwrite=args.overwrite
    )
    print(f"{info['run_id']} ({info['arch']}) -> {info['out_dir']} as {info['class']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="depthbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_text in (
        (
            "shapes",
            cmd_shapes,
            "print L, d_model, ratio, d_ff, heads and exact parameters per shape",
        ),
        ("runs", cmd_runs, "list the runs of the grid with their step and token budgets"),
        ("validate", cmd_validate, "validate a config and report the grid size"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", nargs="?", default="config/config.yaml")
        p.set_defaults(fn=fn)
    p = sub.add_parser(
        "plan", help="per run and in total: FLOPs, tokens, GPU-hours, per-GPU memory, disk"
    )
    p.add_argument("config", nargs="?", default="config/config.yaml")
    p.add_argument(
        "--mfu", type=float, default=0.4, help="model FLOP utilisation assumed (default 0.4)"
    )
    p.add_argument("--gpu", default="H100 SXM", help="GPU name shown (default H100 SXM)")
    p.add_argument(
        "--peak",
        type=float,
        default=989e12,
        help="the GPU's dense bf16 FLOP/s (default 989e12, H100 SXM)",
    )
    p.add_argument(
        "--gpu-memory-gb", type=float, default=80.0, help="memory per GPU in GB (default 80)"
    )
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser(
        "rehearse",
        help="build, step twice, checkpoint, resume and probe each architecture's widest and "
        "deepest shape at full size; measured vs estimated memory",
    )
    p.add_argument("config")
    p.add_argument(
        "--out",
        default="results/rehearsal",
        help="folder for rehearsal.json / .csv and the checkpoints (removed after each shape)",
    )
    p.add_argument(
        "--mode",
        choices=["auto", "real", "meta"],
        default="auto",
        help="auto: real where the estimate fits available memory, else meta; real: refuse what does not fit",
    )
    p.add_argument(
        "--meta",
        action="store_true",
        help="same as --mode meta: build on the meta device, print per-GPU estimates",
    )
    p.add_argument(
        "--archs",
        default="",
        help="comma-separated architectures, in the order to run (default: all of the config)",
    )
    p.add_argument(
        "--shapes",
        default="widest,deepest",
        help="widest, deepest, or both (default; also written widest,deepest)",
    )
    p.add_argument("--tokens", type=int, default=256, help="micro-batch 1 x TOKENS (default 256)")
    p.add_argument(
        "--probe-tokens",
        type=int,
        default=32,
        help="tokens of each of the 2 probe sequences (default 32)",
    )
    p.add_argument(
        "--probe-passes",
        type=int,
        default=1,
        help="items per intervention probe (0: all; default 1)",
    )
    p.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=80.0,
        help="memory per GPU in GB for the meta verdict (default 80)",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: the machine's cores)"
    )
    p.set_defaults(fn=cmd_rehearse)
    p = sub.add_parser(
        "regenerate",
        help="rebuild tables, figures and the HTML report from results/ without training",
    )
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="the config of the results (default: the embedded one)",
    )
    p.add_argument("--cores", type=int, default=2)
    p.add_argument(
        "--provenance",
        default="results/provenance.html",
        help="where Snakemake's provenance report goes",
    )
    p.set_defaults(fn=cmd_regenerate)
    p = sub.add_parser(
        "status",
        help="per run: trained, diverged, probed, scored, missing or stale, and what snakemake would do next",
    )
    p.add_argument("config", nargs="?", default="config/config.yaml")
    p.add_argument("--results", default="results", help="the results folder (default: results)")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser(
        "checksum",
        help="record the SHA-256 of the final weights of runs trained before it was kept "
        "(status: unchecked); a run that has one is verified instead",
    )
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="a run's folder, results/runs/<run_id>"
    )
    p.set_defaults(fn=cmd_checksum)

    p = sub.add_parser(
        "rename-runs",
        help="move run folders trained when every run id hashed the whole "
        "model.arch_options section to today's ids (refuses on conflicts; --dry-run lists)",
    )
    p.add_argument("config", nargs="?", default="config/config.yaml")
    p.add_argument("--results", default="results", help="the results folder (default: results)")
    p.add_argument("--dry-run", action="store_true", help="list what would move and change nothing")
    p.set_defaults(fn=cmd_rename_runs)

    p = sub.add_parser(
        "export",
        help="write a finished run as a transformers model directory (LlamaForCausalLM for pre_ln)",
    )
    p.add_argument("run_dir", help="the run's folder, results/runs/<run_id>")
    p.add_argument("out_dir", help="the model directory to write")
    p.add_argument(
        "--results",
        default=None,
        help="the results folder with tokenizers/ and data/ (default: RUN_DIR/../..)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    p.set_defaults(fn=cmd_export)
    args = parser.parse_args(argv)
    try:
        code = args.fn(args)
    except DepthBenchError as exc:
        print(f"depthbench: {exc}", file=sys.stderr)
        return 2
    except (
        BrokenPipeError
    ):  # the reader stopped early (`depthbench runs CONFIG | head`): not an error
        os.dup2(
            os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno()
        )  # so the exit-time flush is silent
        return 0
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
