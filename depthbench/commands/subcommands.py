"""What each `depthbench` subcommand does (the parser is depthbench.commands.cli): the grid's
shapes, runs and validation, the cost plan, the rehearsal, regeneration of tables and figures,
status, export, and `run`, which checks the YAML of every --configfile
before Snakemake reads it."""

from __future__ import annotations

import os
import sys

from depthbench.grid.config import expand_grid
from depthbench.grid.expand import shape_table
from depthbench.spec.schema import load_config, read_yaml_config
from depthbench.util.errors import ConfigError


def _experiment(path: str):
    return expand_grid(load_config(path))


def _planned_experiment(path: str, results: str):
    """The experiment of config file `path`, through the plan cache of the `results` folder
    (depthbench.grid.plan_cache): `status` on a grid planned before does not import torch."""
    from depthbench.grid.plan_cache import planned_grid

    if not os.path.exists(path):
        raise ConfigError("<configfile>", f"{path} does not exist")
    return planned_grid(
        read_yaml_config(path), {}, os.path.join(results, ".cache", "plans")
    ).experiment


def cmd_shapes(args) -> None:
    exp = _experiment(args.config)
    rows = shape_table(exp)
    budget = exp.config.get("budget", {}).get("params")
    header = (
        f"{'arch':<12} {'L':>4} {'d_model':>8} {'ratio':>7} {'d_ff':>6} {'heads':>6} "
        f"{'kv':>4} {'params':>15}"
    )
    if budget:  # relative, as in runs.parquet: -0.0031 is 0.31% under budget.params
        header += f" {'params_vs_budget':>17}"
    print(header)
    for r in rows:
        line = (
            f"{r['arch']:<12} {r['n_layer']:>4} {r['d_model']:>8} {r['ratio']:>7.1f} "
            f"{r['d_ff']:>6} {r['n_head']:>6} {r['n_kv_head']:>4} {r['params']:>15,}"
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
    from depthbench.grid.extend import extensions_at_most

    exp = _experiment(args.config)
    cells = {(s.arch, s.model.n_layer, s.model.d_model, str(s.knobs)) for s in exp.runs.values()}
    extra = len(next(iter(exp.replicates.values()), {})) * len(cells)
    at_most = extensions_at_most(exp)
    print(
        f"{args.config}: valid; {len(exp.runs)} runs"
        + (f", at most {at_most} past cells' LR edges (lr_sweep.max_extensions)" if at_most else "")
        + (f" and {extra} replicates at the cells' best LRs (seeds_at_best_lr)" if extra else "")
        + f", data {exp.data_id}, tokenizer {exp.tokenizer_id}"
    )
    for line in ignored_settings(exp.config):
        print(f"  ignored (no architecture of the grid reads it): {line}")


def cmd_plan(args) -> None:
    from depthbench.commands.plan import format_plan, plan_experiment
    from depthbench.commands.step_records import find_record

    exp = _experiment(args.config)
    record = find_record(args.record, args.gpu)
    memory = args.gpu_memory_gb * 1e9
    plans = plan_experiment(exp, mfu=args.mfu, peak=args.peak, gpu_memory=memory, record=record)
    print(format_plan(plans, args.gpu, args.mfu, memory, record))


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
                f"depthbench regenerate: snakemake exited with {done.returncode}. "
                "If it names a missing file under results/runs, results/probes, results/nll "
                "or results/removal, that run's outputs were not copied: "
                "regenerate never trains, probes or scores."
            )
    print(
        "tables in results/tables, figures in results/figures, report in results/report.html, "
        f"provenance in {args.provenance}",
        file=sys.stderr,
    )


def cmd_status(args) -> None:
    """Per run: trained / diverged / probed / scored / missing / stale, and the next snakemake
    run's jobs, from the files under results/ (nothing is run; see depthbench.commands.status)."""
    from depthbench.commands.status import format_status

    print(format_status(_planned_experiment(args.config, args.results), args.results))


def cmd_export(args) -> None:
    from depthbench.hf.export import export_run

    info = export_run(
        args.run_dir, args.out_dir, results_dir=args.results, overwrite=args.overwrite
    )
    print(f"{info['run_id']} ({info['arch']}) -> {info['out_dir']} as {info['class']}")


def configfiles(snakemake_args: list[str]) -> list[str]:
    """The files named by --configfile / --configfiles (each may take several values, or be
    written --configfile=FILE) in a Snakemake command line."""
    files, taking = [], False
    for arg in snakemake_args:
        if arg.startswith("--configfile=") or arg.startswith("--configfiles="):
            files.append(arg.split("=", 1)[1])
            taking = False
        elif arg in ("--configfile", "--configfiles"):
            taking = True
        elif taking and not arg.startswith("-"):
            files.append(arg)
        else:
            taking = False
    return files


def cmd_run(args) -> int:
    """Snakemake with the given arguments, after each --configfile has been read as YAML: a
    syntax error names the file, line and column (Snakemake reads a --configfile itself, before
    the Snakefile can check it, and reports only that it is not valid YAML). The merged config is
    then validated by the Snakefile, naming the field."""
    import subprocess

    snakemake_args = [a for a in args.snakemake_args if a != "--"]
    for path in configfiles(snakemake_args):
        read_yaml_config(path)
    command = [sys.executable, "-m", "snakemake", *snakemake_args]
    return subprocess.run(command).returncode
