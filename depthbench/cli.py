"""Command line: `depthbench shapes CONFIG` prints the resolved shape table; `depthbench runs
CONFIG` lists the run ids of the grid; `depthbench validate CONFIG` checks a config."""

from __future__ import annotations

import argparse
import sys

from depthbench.config import expand_grid, load_config, shape_table
from depthbench.errors import DepthBenchError


def _experiment(path: str):
    return expand_grid(load_config(path))


def cmd_shapes(args) -> None:
    exp = _experiment(args.config)
    rows = shape_table(exp)
    budget = exp.config.get("budget", {}).get("params")
    header = f"{'arch':<12} {'L':>4} {'d_model':>8} {'ratio':>7} {'d_ff':>6} {'heads':>6} {'kv':>4} {'params':>15}"
    if budget:
        header += f" {'vs budget':>10}"
    print(header)
    for r in rows:
        line = (f"{r['arch']:<12} {r['n_layer']:>4} {r['d_model']:>8} {r['ratio']:>7.1f} {r['d_ff']:>6} "
                f"{r['n_head']:>6} {r['n_kv_head']:>4} {r['params']:>15,}")
        if budget:
            line += f" {100 * (r['params'] / budget - 1):>+9.2f}%"
        extra = {k: v for k, v in r.items() if k.startswith("knob:")}
        print(line + (f"  {extra}" if extra else ""))


def cmd_runs(args) -> None:
    exp = _experiment(args.config)
    for run_id, spec in exp.runs.items():
        print(run_id, f"steps={spec.train.total_steps}", f"tokens={spec.train.total_steps * spec.train.tokens_per_step:,}")


def cmd_validate(args) -> None:
    exp = _experiment(args.config)
    print(f"{args.config}: valid; {len(exp.runs)} runs, data {exp.data_id}, tokenizer {exp.tokenizer_id}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="depthbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, help_text in (
        ("shapes", cmd_shapes, "print L, d_model, ratio, d_ff, heads and exact parameters per shape"),
        ("runs", cmd_runs, "list the runs of the grid with their step and token budgets"),
        ("validate", cmd_validate, "validate a config and report the grid size"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", nargs="?", default="config/config.yaml")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except DepthBenchError as exc:
        print(f"depthbench: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
