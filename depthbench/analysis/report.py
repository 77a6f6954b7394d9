"""The report: one self-contained, offline HTML file (results/report.html, images embedded as
base64) that opens on the answer: the headline figure, the claims table and the best-LR table
(budget deviation, LR at the edge, seeds) on the first screen, then one section per registry
section with each figure's caption visible under it, and the tables in the page.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis.profile import layer_profile, layer_profile_html
from depthbench.analysis.registry import FIGURES

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0 18px;color:#222;font-size:13px}
h1{font-size:19px;margin:10px 0 2px} h2{font-size:16px;border-bottom:1px solid #ccc;margin-top:26px}
.sub{color:#555;margin:0 0 8px}
.top{display:grid;grid-template-columns:minmax(380px,38%) 1fr;gap:12px;align-items:start}
.top>*{min-width:0;overflow-x:auto}
.top img{max-width:100%;max-height:470px;border:1px solid #ddd}
.top h3{font-size:13px;margin:4px 0}
table{border-collapse:collapse;font-size:11px;width:100%}
th,td{border:1px solid #ddd;padding:1px 4px;text-align:left;vertical-align:top;line-height:1.25}
th{background:#f3f3f3} td.num{text-align:right;font-variant-numeric:tabular-nums}
.holds{background:#dff3df} .contradicted{background:#f8dede} .inconclusive{background:#fbf5dc}
.untestable{background:#f1f1f1;color:#555} .flag{color:#a15c00;font-weight:600}
figure{margin:12px 0 22px} figure img{max-width:100%;max-height:900px;border:1px solid #ddd}
figcaption{max-width:1100px;margin-top:4px;color:#333}
nav a{margin-right:12px} .small{color:#666;font-size:11px}
"""  # noqa: E501


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _verdict_class(v: str) -> str:
    from depthbench.analysis.claims.verdict import CONTRADICTED, HOLDS, INCONCLUSIVE

    return {HOLDS: "holds", CONTRADICTED: "contradicted", INCONCLUSIVE: "inconclusive"}.get(
        v, "untestable"
    )


def _effect(r) -> str:
    """The decisive effect: estimate [95% interval], df and the claim's p-value."""
    effect, e = getattr(r, "effect", ""), getattr(r, "estimate", float("nan"))
    if not effect or e != e:
        return ""
    df = getattr(r, "df", float("nan"))
    dft = "exact" if getattr(r, "test", "").startswith("exact") else (
        "df &infin;" if df == float("inf") else f"df {df:.3g}"
    )  # fmt: skip
    interval = f" [{r.ci_low:.3g}, {r.ci_high:.3g}]" if r.ci_low == r.ci_low else ""
    p = getattr(r, "effect_p", float("nan"))
    p = f", p = {p:.2g}" if p == p else ""
    return f"<b>{html.escape(effect)}</b>: {e:.3g}{interval}, {dft}{p}"


def _ours(r) -> str:
    """Our summary, the decisive effect with its test, then every cell compared with its 95%
    interval and seed count."""
    numbers = getattr(r, "estimates", "") or ""
    effect = _effect(r)
    return (
        html.escape(r.ours or "-")
        + (f"<div>{effect}</div>" if effect else "")
        + (f'<div class="small">{html.escape(numbers)}</div>' if numbers else "")
    )


def _verdict(r, with_note: bool) -> str:
    flag = ' <span class="flag">single seed</span>' if getattr(r, "single_seed", False) else ""
    p, small = getattr(r, "p_value", float("nan")), '<div class="small">{}</div>'
    note = small.format(html.escape(r.note)) if r.note and with_note else ""
    return (
        html.escape(r.verdict)
        + flag
        + (small.format(f"claim p = {p:.2g}") if p == p else "")
        + note
    )


def claims_method(best: pd.DataFrame) -> str:
    """What stands above the claims table: the model, the pooled degrees of freedom (of the
    best-LR loss, best_lr's columns) and the test."""
    pooled = ""
    if R.has(best, "pooled_df", "pooled_sd", "n") and best["pooled_df"].max() > 0:
        row, cells = best.loc[best["pooled_df"].idxmax()], int((best["n"] >= 2).sum())
        pooled = (
            f"for the best-LR loss a seed SD of {row['pooled_sd']:.3g} nats pooled over {cells} "
            f"cells, <b>{int(row['pooled_df'])} degrees of freedom</b>, plus each cell's "
            f"LR-choice variance (SD up to {best['lr_choice_sd'].max():.2g} nats); "
        )
    return (
        '<p class="small"><b>Model and test.</b> Each claim\'s effect is a contrast of cell means '
        "(a cell: an architecture at a depth; its runs: the seeds) estimated from every run: "
        "&ldquo;depth helps X&rdquo; is the least-squares slope of the best-LR loss on "
        "log2(n_layer) over every depth and seed, &ldquo;X differs from Y at depth L&rdquo; the "
        "difference of their cell means. The seed variance is pooled over the grid's cells (one "
        f"per architecture with 10 or more degrees of freedom, else the grid's): {pooled}each "
        "row names its own. Each effect gets a two-sided t test; the verdict at 5%: "
        "<i>holds</i>, every effect the paper's way with p &lt; 0.05; <i>contradicted</i>, one "
        "the opposite way with p &lt; 0.05 after a Bonferroni correction over the claim's "
        "effects; else <i>inconclusive at this scale</i> (under no effect, at most 5% of "
        "verdicts are not inconclusive: tests/unit/test_verdict_calibration.py). Intervals are "
        '95%, inside the quantity\'s range; <span class="flag">single seed</span>: a cell '
        "compared rests on one seed.</p>"
    )


def claims_html(claims: pd.DataFrame, full: bool = False) -> str:
    """The claims table: our numbers with their 95% intervals and seed counts (n) beside each
    verdict, verdicts that rest on one seed flagged; `full` adds how each is computed, the
    source and the note (which names the cells left out because their best run did not learn)."""
    if claims.empty:
        return "<p>No claims table.</p>"
    head = ["claim", "paper", "ours: effect [95% interval], df, p; cells (n seeds)", "verdict"] + (
        ["how ours is computed", "seed variance", "source", "note"] if full else []
    )
    rows = []
    for r in claims.itertuples():
        cells = [
            f"<b>({r.claim_id[0]})</b> {html.escape(r.claim)}",
            html.escape(r.paper),
            _ours(r),
            _verdict(r, with_note=not full),
        ]
        if full:
            cells += [html.escape(r.method), html.escape(getattr(r, "variance", "") or "")]
            cells += [html.escape(r.source), html.escape(r.note or "")]
        rows.append(
            f'<tr class="{_verdict_class(r.verdict)}">'
            + "".join(f"<td>{c}</td>" for c in cells)
            + "</tr>"
        )
    return (
        "<table><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )


def best_lr_html(best: pd.DataFrame, budget: float | None) -> str:
    """The best-LR table: loss [its pooled 95% interval], budget deviation, LR at edge, seeds."""
    if best.empty:
        return "<p>No best-LR table: every run diverged or none was trained.</p>"
    order = R.archs(best)
    best = best.sort_values(
        ["arch", "n_layer"], key=lambda c: c.map(order.index) if c.name == "arch" else c
    )
    head = [
        "arch",
        "L",
        "d",
        "ratio",
        "params",
        "vs budget",
        "best LR",
        "val loss [95%]",
        "seeds",
        "LR at edge",
        "diverged / LRs",
    ]
    rows = []
    for r in best.to_dict("records"):
        dev = r.get("params_vs_budget", r["params"] / budget - 1 if budget else float("nan"))
        low, high = r.get("ci_low", float("nan")), r.get("ci_high", float("nan"))
        loss = f"{r['final_val_loss']:.4f}" + (f" [{low:.3f}, {high:.3f}]" if low == low else "")
        edge = r.get("lr_at_edge")
        cells = [
            html.escape(r["arch"] if r["knobs"] == "{}" else f"{r['arch']} {r['knobs']}"),
            r["n_layer"],
            r["d_model"],
            f"{r['ratio']:.1f}",
            f"{int(r['params']):,}",
            f"{100 * dev:+.2f}%" if dev == dev else "-",
            f"{r['best_lr']:g}",
            loss,
            r.get("n_seeds", "-"),
            "yes" if edge is True else "no" if edge is False else "-",
            f"{r.get('n_diverged', '-')} / {r.get('n_lrs_tried', '-')}",
        ]
        rows.append(
            "<tr>"
            + "".join(
                f'<td class="num">{c}</td>' if i else f"<td>{c}</td>" for i, c in enumerate(cells)
            )
            + "</tr>"
        )
    return (
        "<table><tr>"
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )


RUN_COLUMNS = ("run_id", "arch", "n_layer", "d_model", "params", "lr", "seed", "status",
               "final_val_loss", "tokens_seen", "device")  # fmt: skip


def runs_html(runs: pd.DataFrame) -> str:
    if runs.empty:
        return "<p>No runs.</p>"
    cols = [c for c in RUN_COLUMNS if c in runs]
    return runs[cols].to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0)


def build_report(names: list[str], figure_dir: str | Path, tables: dict, settings: dict) -> str:
    """The report's HTML text; figures that were not drawn are listed as missing."""
    figure_dir = Path(figure_dir)
    claims, best, runs = (tables.get(k, pd.DataFrame()) for k in ("claims", "best_lr", "runs"))
    budget = settings.get("budget", {}).get("params")
    grid = R.grid_line(settings)
    archs = ", ".join(R.archs(runs)) or "none"
    headline = figure_dir / "headline.png"
    top_img = _img(headline, "headline") if headline.exists() else "<p>headline figure missing</p>"
    sections: dict[str, list[str]] = {}
    for name in names:
        fig, png = FIGURES[name], figure_dir / f"{name}.png"
        body = _img(png, name) if png.exists() else f"<p>{name}.png was not drawn.</p>"
        sections.setdefault(fig.section, []).append(
            f'<figure id="{name}">{body}<figcaption><b>{name}.</b> '
            f"{html.escape(fig.caption)}</figcaption></figure>"
        )
    nav = "".join(f'<a href="#s{i}">{html.escape(s)}</a>' for i, s in enumerate(sections))
    profile = layer_profile(
        tables.get("probes", pd.DataFrame()), tables.get("effective_depth", pd.DataFrame())
    )
    tolerance = settings.get("removal", {}).get("tolerance", 0.05)
    profile_part = (
        "<h3>Layer profile: how much of each model's depth does work (best-LR runs and pretrained "
        f"models)</h3>{layer_profile_html(profile, tolerance)}"
    )
    # the first screen holds the claims this grid can test; the rest are counted and listed in
    # full below
    testable = (
        claims[~claims["verdict"].str.startswith("not testable")] if not claims.empty else claims
    )
    untested = len(claims) - len(testable)
    claims_part = (
        "<h3>Claims of the source papers (sources and methods: "
        "<a href='#claims'>Claims in full</a>)</h3>"
        + claims_method(best)
        + (
            claims_html(testable)
            if not testable.empty
            else "<p>No claim is testable in this grid.</p>"
        )
        + (
            f'<p class="small">{untested} more not testable in this grid (what each lacks: '
            "<a href='#claims'>Claims in full</a>).</p>"
            if untested
            else ""
        )
    )
    # with pretrained models the grid's question is their profile beside the trained runs'; the
    # claims, which need a trained grid of several shapes, follow
    pretrained = "status" in runs.columns and (runs["status"] == "pretrained").any()
    right = profile_part + claims_part if pretrained else claims_part + profile_part
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>DepthBench {html.escape(settings.get('name', ''))}</title>"
        f"<style>{CSS}</style></head><body>",
        "<h1>DepthBench: does depth at a fixed budget turn into computation? "
        f"Config <tt>{html.escape(settings.get('name', ''))}</tt></h1>",
        f'<p class="sub">{html.escape(archs)}; {html.escape(grid)}. Claims measured at: '
        f"{html.escape(claims['scale'].iloc[0] if not claims.empty else '-')}.</p>",
        f'<div class="top"><div>{top_img}<h3>Best learning rate per shape</h3>'
        f"{best_lr_html(best, budget)}</div>",
        f"<div>{right}</div></div>",
        f'<p class="small">{html.escape(FIGURES["headline"].caption)}</p>',
        f"<nav>{nav}</nav>",
    ]
    for i, (section, figs) in enumerate(sections.items()):
        parts.append(f'<h2 id="s{i}">{html.escape(section)}</h2>' + "".join(figs))
    parts += [
        f"<h2 id='claims'>Claims in full</h2>{claims_html(claims, full=True)}",
        f"<h2>Runs</h2>{runs_html(runs)}",
        '<p class="small">Tables: results/tables/*.parquet. Provenance (rules, code, logs): '
        "results/provenance.html via snakemake --report.</p>",
        "</body></html>",
    ]
    return "\n".join(parts)
