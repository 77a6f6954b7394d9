"""Loss figures: the headline (validation loss at the best LR against shape), loss against
learning rate, and training and validation loss curves. Drawn from runs, best_lr and curves."""

from __future__ import annotations

import pandas as pd

from depthbench.analysis import readers as R
from depthbench.analysis import not_learned as NL
from depthbench.analysis import style as S
from depthbench.analysis import summaries as SM

WHAT_HEADLINE = "validation loss at the best LR vs shape (fixed budget)"


def _budget_deviation(
    best: pd.DataFrame, runs: pd.DataFrame, budget: float | None
) -> pd.Series | None:
    """Relative parameter deviation from the budget per best_lr row: the table's column
    `params_vs_budget` when present, else params / budget - 1 (the config's budget)."""
    if "params_vs_budget" in best.columns:
        return best["params_vs_budget"].astype(float)
    if budget:
        return best["params"].astype(float) / budget - 1.0
    return None


def _removable_by_shape(depth: pd.DataFrame) -> pd.DataFrame:
    """Per best-LR cell (first seed): the largest fraction of layers a non-random ranking removes
    within the tolerance (effective_depth.parquet), with the cell's shape and d_model /
    n_layer."""
    if not R.has(depth, "arch", "knobs", "ratio", "ranking", "effective_fraction"):
        return pd.DataFrame()
    removable = R.removable(depth)
    removable = removable[(removable["status"] != "pretrained") & removable["removable"].notna()]
    return removable.rename(columns={"removable": "effective_fraction"})[
        [*R.SHAPE_KEYS, "ratio", "effective_fraction"]
    ].reset_index(drop=True)


def _seed_text(best: pd.DataFrame, seeds: pd.Series) -> str:
    """What the headline's bars are, from best_lr's interval columns: the pooled model's
    (depthbench.analysis.best_loss) where the table has them, else the t interval over seeds."""
    if "ci_low" not in best.columns:
        return "no interval columns in best_lr"
    if seeds.empty:
        return ""
    if "pooled_df" in best.columns:
        df = int(best["pooled_df"].max()) if best["pooled_df"].notna().any() else 0
        if df == 0:
            return "n=1 in every cell (one seed): no interval"
        sd = float(best.loc[best["pooled_df"] == df, "pooled_sd"].iloc[0])
        bars = f"bars: 95% interval, seed SD {sd:.2g} pooled over the cells ({df} df) + LR choice"
        return bars + ("; n=1: one seed" if (seeds == 1).any() else "")
    if (seeds == 1).all():
        return "n=1 in every cell (one seed): no interval"
    several = "/".join(str(int(k)) for k in sorted(set(seeds[seeds >= 2])))
    bars = f"bars: 95% t interval over {several} seeds"
    return bars + ("; n=1: one seed, no interval" if (seeds == 1).any() else "")


def headline(tables: dict, ctx: S.Context):
    """Top: loss at the best LR (its 95% interval as bars: the seed variance pooled over the
    cells plus the LR choice's, best_lr's ci_low / ci_high; "n=1" beside a cell of one seed
    among cells of several, open markers where the best LR is at the edge of the
    swept range) against d_model / n_layer; middle, where the grid has layer removal: the
    fraction of layers removable within the tolerance (effective depth, the best ranking);
    bottom: budget deviation. In the top and middle panels a cell whose best-LR runs did not
    learn (readers.not_learned_keys) is a cross off the line, without a bar."""
    best, runs = tables.get("best_lr", pd.DataFrame()), tables.get("runs", pd.DataFrame())
    if not R.has(best, "arch", "ratio", "final_val_loss"):
        why = (
            "no run finished without diverging"
            if R.has(runs, "status")
            else "no runs in the tables"
        )
        return S.message_figure(ctx, WHAT_HEADLINE, why)
    removable = _removable_by_shape(tables.get("effective_depth", pd.DataFrame()))
    # cells whose best-LR runs all ended within analysis.learned_margin of the unigram floor
    flat_keys, crosses = R.not_learned_keys(tables), 0
    if removable.empty:
        fig, (ax, dev_ax) = S.panels(
            2, ctx, cols=1, scale=1.0, gridspec_kw={"height_ratios": [3, 1]}, sharex=True
        )
    else:
        fig, (ax, rem_ax, dev_ax) = S.panels(
            3, ctx, cols=1, scale=1.15, gridspec_kw={"height_ratios": [3, 1.2, 1]}, sharex=True
        )
        rem_curves = {
            S.label(arch, knobs): (arch, g.sort_values("ratio"))
            for (arch, knobs), g in removable.groupby(["arch", "knobs"], sort=False)
        }
        rem_groups = S.coinciding(
            {n: g.set_index("ratio")["effective_fraction"] for n, (_, g) in rem_curves.items()}
        )
        for name, (arch, g) in rem_curves.items():  # coinciding curves nest their markers, as below
            st = S.arch_style(arch)
            rank = next((c.index(name) for c in rem_groups if name in c), 0)
            crosses += NL.trend(
                rem_ax,
                g["ratio"],
                g["effective_fraction"],
                R.in_cells(g, flat_keys),
                {**st, "markersize": st["markersize"] * (1.9 - 0.55 * rank)},
            )
        tolerance = ctx.thresholds.get("removal_tolerance", 0.05)
        rem_ax.set_ylabel(f"layers removable\nwithin {tolerance:.0%} (fraction)")
        rem_ax.set_ylim(-0.05, 1.0)
        rem_ax.grid(alpha=0.3)
    deviation = _budget_deviation(best, runs, ctx.budget)
    seeds = best["n"] if "n" in best.columns else best.get("n_seeds", pd.Series(dtype=int))
    mixed_n = "n" in best.columns and (seeds == 1).any() and (seeds >= 2).any()
    curves, dev_curves = {}, {}
    series = list(
        best[["arch", "knobs"]]
        .drop_duplicates()
        .sort_values("arch", key=lambda a: a.map(R.archs(best).index))
        .itertuples(index=False)
    )
    for k, (arch, knobs) in enumerate(series):
        g = best[(best["arch"] == arch) & (best["knobs"] == knobs)].sort_values("ratio")
        st, name, flat = S.arch_style(arch), S.label(arch, knobs), R.in_cells(g, flat_keys)
        crosses += NL.trend(ax, g["ratio"], g["final_val_loss"], flat, st, name)
        if R.has(g, "ci_low", "ci_high"):  # side by side at a shared ratio, not on one another
            x = SM.dodge(g["ratio"], k, len(series))
            SM.error_bars(ax, x, g["ci_low"], g["ci_high"], st["color"], skip=flat)
        if mixed_n:  # some cells have one seed, others several: say which have no interval
            for one in g[g["n"] == 1].itertuples():
                ax.annotate(
                    "n=1",
                    (one.ratio, one.final_val_loss),
                    xytext=(4, -9),
                    textcoords="offset points",
                    fontsize=S.FONT["tick"] - 1,
                    color=st["color"],
                )
        if "lr_at_edge" in g.columns:
            edge = g[g["lr_at_edge"].fillna(False).astype(bool)]
            ax.scatter(
                edge["ratio"],
                edge["final_val_loss"],
                s=120,
                facecolors="none",
                edgecolors=st["color"],
                linewidths=1.5,
            )
        curves[name] = g.set_index("ratio")["final_val_loss"]
        if deviation is not None:
            dev_curves[name] = (
                st,
                pd.Series(100 * deviation[g.index].to_numpy(), index=g["ratio"].to_numpy()),
            )
    # Architectures of equal shapes have equal deviations: each later one of a coinciding group
    # is drawn with a smaller marker over the earlier, so every colour stays visible.
    dev_groups = S.coinciding({name: c for name, (_, c) in dev_curves.items()})
    for name, (st, c) in dev_curves.items():
        rank = next((g.index(name) for g in dev_groups if name in g), 0)
        dev_ax.plot(
            c.index,
            c.values,
            linestyle=":",
            **{**st, "markersize": st["markersize"] * (1.9 - 0.55 * rank)},
        )
    S.floor_line(ax, R.unigram_floor(runs))
    ax.set_ylabel("validation loss at best LR\n(nats/token)")
    ax.grid(alpha=0.3)
    extra = (
        "open circle: best LR at the edge of the swept LRs"
        if "lr_at_edge" in best.columns
        else "LR-at-edge not in best_lr table"
    )
    flat_text = NL.not_learned_text(crosses, bars=R.has(best, "ci_low", "ci_high"))
    ax.set_title(
        "; ".join(p for p in (extra, _seed_text(best, seeds)) if p)
        + (f"\n{flat_text}" if flat_text else ""),
        fontsize=S.FONT["label"],
    )
    S.legend(ax, ncol=2 if len(curves) > 5 else 1)
    if deviation is None:
        S.note(dev_ax, "budget deviation unknown (no params_vs_budget, no budget)")
    dev_ax.axhline(0, color="0.5", linewidth=0.8)
    dev_ax.set_ylabel("params vs\nbudget (%)")
    dev_ax.grid(alpha=0.3)
    S.log_ticks(dev_ax, best["ratio"].round(1))
    dev_ax.set_xlabel("d_model / n_layer (log scale; deeper and narrower to the left)")
    notes = [S.coincide_text(g) for g in (S.coinciding(curves),) if g]
    if dev_groups:  # equal shapes, not a drawing accident: say so under the budget panel
        notes.append(
            "budget panel: "
            + "; ".join(" = ".join(g) for g in dev_groups)
            + " have the same shapes (nested markers)"
        )
    if not removable.empty and rem_groups:
        notes.append(
            "removal panel: "
            + "; ".join(" = ".join(g) for g in rem_groups)
            + " can lose the same fraction of layers (nested markers)"
        )
    if notes:
        S.fig_note(fig, "\n".join(notes))
    S.title(fig, ctx, WHAT_HEADLINE)
    return fig


def loss_vs_lr(tables: dict, ctx: S.Context):
    """Final validation loss against learning rate, one panel per shape; diverged runs as x at
    the top of the panel."""
    runs = tables.get("runs", pd.DataFrame())
    shapes = R.shapes(runs)
    if not shapes:
        return S.message_figure(ctx, "loss vs learning rate", "no runs in the tables")
    fig, axes = S.panels(len(shapes), ctx, cols=3, sharey=True)
    finite = runs.loc[runs["status"] == "ok", "final_val_loss"].dropna()
    floor = R.unigram_floor(runs)
    top = float(finite.max()) if not finite.empty else (floor or 1.0)
    for ax, (n_layer, d_model) in zip(axes, shapes):
        sub = runs[runs["n_layer"] == n_layer]
        for (arch, knobs), g in sub.groupby(["arch", "knobs"]):
            st = S.arch_style(arch)
            ok = g[g["status"] == "ok"].groupby("lr", as_index=False)["final_val_loss"].mean()
            ax.plot(ok["lr"], ok["final_val_loss"], label=S.label(arch, knobs), **st)
            bad = g[g["status"] != "ok"]
            ax.scatter(bad["lr"], [top * 1.02] * len(bad), marker="x", color=st["color"])
        if (sub["status"] != "ok").all():
            S.note(ax, "every run at this shape diverged")
        S.floor_line(ax, floor)
        S.log_ticks(ax, runs["lr"])
        ax.set_title(f"L={n_layer}, d={d_model}")
        ax.set_xlabel("peak learning rate")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final validation loss (nats/token)\nx: diverged")
    S.legend(axes[-1])
    S.title(fig, ctx, "final validation loss vs learning rate")
    return fig


def loss_curves(tables: dict, ctx: S.Context):
    """Training loss (every logged step, thin) and validation loss (markers) against training
    tokens, one panel per architecture, one colour per shape, at each shape's best LR."""
    runs, best, curves = (tables.get(k, pd.DataFrame()) for k in ("runs", "best_lr", "curves"))
    chosen = R.first_seed(R.best_runs(runs, best))
    if chosen.empty or not R.has(curves, "run_id", "tokens"):
        why = (
            "no run finished without diverging"
            if R.has(runs, "status")
            else "no runs or curves in the tables"
        )
        return S.message_figure(ctx, "training and validation loss", why)
    archs = R.archs(chosen)
    fig, axes = S.panels(len(archs), ctx, cols=3, sharey=True)
    depths = sorted(chosen["n_layer"].unique())
    cmap = S.plt.get_cmap("viridis")
    for ax, arch in zip(axes, archs):
        for row in chosen[chosen["arch"] == arch].sort_values("n_layer").itertuples():
            c = curves[curves["run_id"] == row.run_id].sort_values("tokens")
            color = cmap(depths.index(row.n_layer) / max(1, len(depths) - 1) * 0.85)
            tr = c.dropna(subset=["train_loss"]) if "train_loss" in c else c.iloc[0:0]
            ax.plot(tr["tokens"], tr["train_loss"], color=color, linewidth=0.8, alpha=0.6)
            va = c.dropna(subset=["val_loss"]) if "val_loss" in c else c.iloc[0:0]
            ax.plot(
                va["tokens"],
                va["val_loss"],
                color=color,
                marker="o",
                markersize=4,
                linewidth=1.5,
                label=f"L={row.n_layer}, d={row.d_model}, LR {row.lr:g}",
            )
        S.floor_line(ax, R.unigram_floor(runs))
        ax.set_title(arch)
        ax.set_xlabel("training tokens")
        S.count_axis(ax)
        ax.grid(alpha=0.3)
        S.legend(ax)
    axes[0].set_ylabel("loss (nats/token)\nthin: train, dots: validation")
    S.title(fig, ctx, "training (thin) and validation (dots) loss at the best LR")
    return fig
