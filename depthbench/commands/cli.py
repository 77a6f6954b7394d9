"""Command line: `depthbench shapes CONFIG` prints the resolved shape table; `depthbench runs
CONFIG` lists the run ids of the grid; `depthbench validate CONFIG` checks a config;
`depthbench regenerate [CONFIG]` rebuilds every table, figure and the HTML report from the run
outputs under results/ without training, probing or scoring anything; `depthbench status
[CONFIG]` tells, per run, what is done, missing or stale and what snakemake would do next;
`depthbench rehearse CONFIG` builds, steps, checkpoints, resumes and probes each architecture's
widest and deepest shape at full size (depthbench.commands.rehearse.rehearsal); `depthbench run
SNAKEMAKE_ARGS` runs Snakemake after reading every --configfile as YAML. What each does is in
depthbench.commands.subcommands."""

from __future__ import annotations

import argparse
import os
import sys

from depthbench.commands.subcommands import (
    cmd_checksum,
    cmd_export,
    cmd_plan,
    cmd_regenerate,
    cmd_rehearse,
    cmd_runs,
    cmd_shapes,
    cmd_status,
    cmd_validate,
    cmd_run,
)
from depthbench.util.errors import DepthBenchError


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
    p.add_argument(
        "--record",
        default="auto",
        help="measured step times to price the runs by: a record's path, none, or auto (the "
        "record in benchmarks/records/ named after --gpu, else the only one there)",
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
        help=(
            "auto: real where the estimate fits available memory, else meta; "
            "real: refuse what does not fit"
        ),
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
        help=(
            "per run: trained, diverged, probed, scored, missing or stale, "
            "and what snakemake would do next"
        ),
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
    p = sub.add_parser(
        "run",
        help="snakemake with these arguments, after every --configfile has been read as YAML "
        "(a syntax error names the file, line and column)",
    )
    p.add_argument(
        "snakemake_args",
        nargs=argparse.REMAINDER,
        metavar="SNAKEMAKE_ARGS",
        help="passed to snakemake as they are, e.g. --cores 2 --configfile my.yaml "
        "(`depthbench run --help` is Snakemake's help)",
    )
    p.set_defaults(fn=cmd_run)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # everything after `run` is Snakemake's, options included
        args = argparse.Namespace(snakemake_args=argv[1:], fn=cmd_run)
    else:
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
