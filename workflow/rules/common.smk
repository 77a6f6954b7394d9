# Helpers shared by the rule files.

wildcard_constraints:
    run_id="[A-Za-z0-9_.+-]+",
    round="[0-9]+",


from depthbench.grid.extend import ladders

# The LR sweep's rounds (the lr_sweep checkpoint, aggregate.smk): where the grid has extensions
# past its cells' edges (lr_sweep.max_extensions) or replicates at their best LRs
MAX_EXTENSIONS = config["lr_sweep"]["max_extensions"]
SWEEP_ROUNDS = bool(EXP.replicates or EXP.extensions)
SWEEP_RUNS = {**RUNS, **EXP.extensions}  # the runs at the sweep's seeds: the grid's, extensions
LADDERS = ladders(RUNS, EXP.extensions)


def in_grid_order(chosen):
    return [run_id for run_id in ALL_RUNS if run_id in chosen]


def sweep_round_inputs(wildcards):
    """Input function of round k: the grid's runs' summaries, and those of every run round k-1
    had tried or called for."""
    k = int(wildcards.round)
    if k == 0:
        ids = list(RUNS)
    else:
        from depthbench.analysis.tables import lr_sweep_run_ids

        before = checkpoints.lr_sweep.get(round=k - 1).output.sweep
        ids = in_grid_order(lr_sweep_run_ids(before, ["tried_run_ids", "next_run_ids"]))
    return [f"{RESULTS}/runs/{run_id}/summary.json" for run_id in ids]


def last_sweep_round():
    """The LR sweep's last round's table: the first that calls for nothing (Snakemake waits for
    each round it reads)."""
    from depthbench.analysis.lr_rounds import calls

    for k in range(MAX_EXTENSIONS + 1):
        path = checkpoints.lr_sweep.get(round=k).output.sweep
        if k == MAX_EXTENSIONS or not calls(path):
            return path


def settled_outputs(k):
    """Input function of `all`: the outputs round k of the LR sweep makes known for the cells it
    has settled: their replicates' summaries and, with best-LR evaluation, the probe, NLL and
    removal outputs of their runs at the best LR. Listed round by round, they start while a
    later round's extensions still train, instead of waiting for the last round."""

    def outputs(wildcards):
        import pandas as pd

        from depthbench.analysis.lr_rounds import calls

        for j in range(k):  # no round k when an earlier one called for nothing
            if not calls(checkpoints.lr_sweep.get(round=j).output.sweep):
                return []
        table = pd.read_parquet(checkpoints.lr_sweep.get(round=k).output.sweep)
        settled = table[table["settled"]]
        replicas = {r for ids in settled["replicate_run_ids"] for r in ids}
        paths = [f"{RESULTS}/runs/{run_id}/summary.json" for run_id in in_grid_order(replicas)]
        best = in_grid_order(replicas | {r for ids in settled["sweep_run_ids"] for r in ids})
        for stage, on in (("probes", True), ("nll", True), ("removal", REMOVAL_ON)):
            sets = "probes" if stage == "removal" else stage
            if on and config[sets]["enabled"] and config[sets]["runs"] == "best_lr":
                paths += [f"{RESULTS}/{stage}/{run_id}.parquet" for run_id in best]
        return paths

    return outputs


def tabled_runs():
    """The run ids the tables merge: the grid's runs (the LR sweep) and, where the sweep has
    rounds, the extensions it trained and the replicates at each cell's best LR, read from its
    last round, so Snakemake schedules them only once the rounds before have run."""
    if not SWEEP_ROUNDS:
        return list(RUNS)
    from depthbench.analysis.tables import lr_sweep_run_ids

    chosen = lr_sweep_run_ids(last_sweep_round(), ["tried_run_ids", "replicate_run_ids"])
    return list(RUNS) + [run_id for run_id in in_grid_order(chosen) if run_id not in RUNS]


def run_outputs(name):
    """Input function: paths of one declared output file for every run the tables merge."""
    return lambda wildcards: [f"{RESULTS}/runs/{run_id}/{name}" for run_id in tabled_runs()]


def train_threads(wildcards):
    # In-process and local training use the job's own cores; SLURM jobs use none here.
    return 1 if config["launcher"]["backend"] == "slurm" else config["train"]["threads"]


from depthbench.launch.executors import ranks_per_run

RANKS_PER_RUN = ranks_per_run(config["launcher"])


def slurm_request(key):
    launcher = config["launcher"]
    return launcher["slurm"][key] if launcher["backend"] == "slurm" else 0


from depthbench.analysis.registry import of_rule, tables_of

# The figures this grid gets, from its architectures' declared probes and figures (registry).
GRID_FIGURES = PLAN.figures


def figure_outputs(rule):
    """PNG and PDF outputs of the grid's figures drawn by one rule, as {name_png: ..., name_pdf: ...}."""
    out = {}
    for name in of_rule(GRID_FIGURES, rule):
        out[f"{name}_png"] = f"{RESULTS}/figures/{name}.png"
        out[f"{name}_pdf"] = f"{RESULTS}/figures/{name}.pdf"
    return out


def figure_inputs(rule):
    """The tables the rule's figures read, as {table: path}."""
    # the removal tables exist only where the grid removes layers; figures draw without them
    return {t: f"{RESULTS}/tables/{t}.parquet" for t in tables_of(of_rule(GRID_FIGURES, rule))
            if REMOVAL_ON or t not in ("removal", "effective_depth")}


# What figures and claims state about the grid; figure rules rerun when it changes, nothing else.
FIGURE_SETTINGS = {
    "name": config["name"],
    "figures": config["figures"],
    "budget": config.get("budget", {}),
    "shapes": config["shapes"],
    "learning_rates": config["learning_rates"],
    "learning_rates_by_arch": config["learning_rates_by_arch"],
    "seeds": config["seeds"],
    "seeds_at_best_lr": config["seeds_at_best_lr"],
    "arch_options": config["model"]["arch_options"],
    "probes": {k: config["probes"][k] for k in ("causal_threshold", "permutation_threshold", "usefulness_threshold", "dead_zone_threshold")},
    "removal": {k: config["removal"][k] for k in ("enabled", "tolerance")},
    "pretrained": [p["name"] for p in config.get("pretrained") or []],
}


def evaluated_runs(stage):
    """Input function: the run ids whose `stage` (probes | nll) outputs the tables merge. With
    `{stage}.runs: all` every run of the grid; with `best_lr` the runs at their cell's best LR,
    read from the tables checkpoint's best_lr.parquet, so Snakemake schedules those jobs only
    after every run of the grid has trained. Where the LR sweep has rounds its last round has
    made the same choice (on the sweep's seeds) before the replicates train: its table names the
    runs, so their evaluation starts beside the replicates' training, not after it."""

    def run_ids(wildcards):
        if config[stage]["runs"] == "all":
            return tabled_runs()
        import pandas as pd

        from depthbench.analysis.tables import best_lr_run_ids, lr_sweep_run_ids

        if SWEEP_ROUNDS:
            chosen = lr_sweep_run_ids(last_sweep_round(), ["sweep_run_ids", "replicate_run_ids"])
            return in_grid_order(chosen)
        out = checkpoints.tables.get().output
        return best_lr_run_ids(pd.read_parquet(out.runs), pd.read_parquet(out.best_lr), ALL_RUNS)

    return run_ids
