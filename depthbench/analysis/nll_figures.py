"""Teacher-forced NLL figures from results/tables/nll.parquet: bits per byte per domain
(code, STEM, math) against d_model / n_layer, at each architecture's best LR, with each cell's
95% interval (analysis.summaries: over seeds, or with one seed the run's bootstrap over the
domain's documents)."""

from __future__ import annotations

import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis import not_learned as NL
from depthbench.analysis import style as S
from depthbench.analysis import summaries as SM


def nll_vs_ratio(tables: dict, ctx: S.Context):
    """One panel per domain, one line per architecture (seeds combined), a bar per cell; a cell
    that did not learn is a cross off the line, without a bar."""
    nll = tables.get("nll", pd.DataFrame())
    if not R.has(nll, "level", "domain", "bits_per_byte", "is_best_lr"):
        return S.message_figure(
            ctx, "teacher-forced NLL by domain", "no NLL rows (nll disabled or no runs)"
        )
    data = nll[
        (nll["level"] == "domain")
        & nll["is_best_lr"].fillna(False).astype(bool)
        & (nll["status"] == "ok")
    ]
    if data.empty:
        return S.message_figure(
            ctx, "teacher-forced NLL by domain", "no NLL rows of a run that did not diverge"
        )
    domains = sorted(data["domain"].unique())
    estimates = SM.cells(data, SM.CELL_KEYS + ["domain"], value="bits_per_byte")
    fig, axes = S.panels(len(domains), ctx, cols=3)
    flat_keys, crosses = R.not_learned_keys(tables), 0
    for ax, domain in zip(axes, domains):
        part = data[data["domain"] == domain]
        cells = estimates[estimates["domain"] == domain]
        series = sorted(
            cells.groupby(["arch", "knobs"]), key=lambda kv: R.archs(part).index(kv[0][0])
        )
        for k, ((arch, knobs), g) in enumerate(series):
            g, st = g.sort_values("ratio"), S.arch_style(arch)
            flat = R.in_cells(g, flat_keys)
            crosses += NL.trend(ax, g["ratio"], g["value"], flat, st, S.label(arch, knobs))
            x = SM.dodge(g["ratio"], k, len(series))  # bars side by side at a shared ratio
            SM.error_bars(ax, x, g["ci_low"], g["ci_high"], st["color"], skip=flat)
        S.log_ticks(ax, part["ratio"].round(1))
        n_docs = f" ({int(part['n_docs'].iloc[0])} docs)" if "n_docs" in part else ""
        ax.set_title(f"{domain}{n_docs}")
        ax.set_xlabel("d_model / n_layer (log)")
        ax.set_ylabel("teacher-forced NLL (bits per byte)")
        ax.grid(alpha=0.3)
    S.legend(axes[-1])
    bars = "bars: " + SM.interval_text(estimates, "the domain's documents")
    S.fig_note(fig, "\n".join(p for p in (bars, NL.not_learned_text(crosses, bars=True)) if p))
    S.title(fig, ctx, "teacher-forced NLL by domain at the best LR")
    return fig
