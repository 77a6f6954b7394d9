# Helpers shared by the rule files.

wildcard_constraints:
    run_id="[A-Za-z0-9_.+-]+",


def run_outputs(name):
    """Paths of one declared output file for every run of the grid."""
    return [f"{RESULTS}/runs/{run_id}/{name}" for run_id in RUNS]


def train_threads(wildcards):
    # In-process and local training use the job's own cores; SLURM jobs use none here.
    return 1 if config["launcher"]["backend"] == "slurm" else config["train"]["threads"]


from depthbench.launch import ranks_per_run

RANKS_PER_RUN = ranks_per_run(config["launcher"])


def slurm_request(key):
    launcher = config["launcher"]
    return launcher["slurm"][key] if launcher["backend"] == "slurm" else 0


def probe_figures(architectures):
    """The probe figures this grid can draw (a figure needs its architectures in the grid)."""
    names = ["angular_distance", "probe_shares", "token_similarity_init", "effective_rank"]
    if any(not a.startswith("attnres") for a in architectures):
        names.append("usefulness")
    if {"hc", "mhc"} & set(architectures):
        names.append("residual_product_rank")
    if {"attnres_full", "attnres_block"} & set(architectures):
        names.append("depth_mixing")
    return names


PROBE_FIGURES = probe_figures([spec.arch for spec in RUNS.values()])


def figure_outputs(names, category):
    """PNG (shown in the HTML report, with the caption workflow/report/<name>.rst) and PDF
    outputs of figure rules, as {name_png: ..., name_pdf: ...}."""
    out = {}
    for name in names:
        out[f"{name}_png"] = report(
            f"{RESULTS}/figures/{name}.png",
            caption=f"../report/{name}.rst",
            category=category,
            labels={"figure": name, "config": config["name"]},
        )
        out[f"{name}_pdf"] = f"{RESULTS}/figures/{name}.pdf"
    return out
