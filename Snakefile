# DepthBench: config grid -> token shards -> training runs -> probes -> tables -> figures.
# All logic lives in the `depthbench` package; rules only wire files together.
from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

min_version("9.0")

# The embedded default, unless a config is given with --configfile (presets are complete
# configs: merging them over the default would leak its settings into them).
if not workflow.config_settings.configfiles:
    from depthbench.spec.schema import read_yaml_config
    from depthbench.util.errors import ConfigError

    try:  # Snakemake's own message for a YAML syntax error names neither the file nor the line
        read_yaml_config("config/config.yaml")
    except ConfigError as exc:
        raise WorkflowError(f"DepthBench config error: {exc}") from None

    configfile: "config/config.yaml"


from depthbench.grid.plan_cache import planned_grid
from depthbench.spec.run import short_hash
from depthbench.util.errors import DepthBenchError

try:
    # validates the config in place (defaults filled, --config's nested strings such as '1' read
    # by the schema's types; the field named on error) and expands the grid; a config planned
    # before with this code comes from results/.cache/plans without importing torch
    PLAN = planned_grid(config, workflow.config_settings.config, "results/.cache/plans")
    EXP = PLAN.experiment
except DepthBenchError as exc:
    raise WorkflowError(f"DepthBench config error: {exc}") from None

RESULTS = "results"
RUNS = EXP.runs  # the grid's product: the LR sweep
# the sweep, every extension past a cell's edge (lr_sweep.max_extensions) and every replicate
# `seeds_at_best_lr` may add (which of them exist: tabled_runs, common.smk)
ALL_RUNS = EXP.candidate_runs
DATA_DIR = f"{RESULTS}/data/{EXP.data_id}"
TOKENIZER = f"{RESULTS}/tokenizers/{EXP.tokenizer_id}/tokenizer.json"
EXPERIMENT = config["name"]
REMOVAL_ON = config["removal"]["enabled"] and config["probes"]["enabled"]  # its rankings are probe rows

include: "workflow/rules/common.smk"
include: "workflow/rules/pretrained.smk"
include: "workflow/rules/tokenize.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/probes.smk"
include: "workflow/rules/nll.smk"
include: "workflow/rules/removal.smk"
include: "workflow/rules/figures.smk"


report: "workflow/report/workflow.rst"


rule all:
    default_target: True
    input:
        rules.tables.output,
        rules.probes_table.output if config["probes"]["enabled"] else [],
        rules.cost_table.output,
        rules.nll_table.output if config["nll"]["enabled"] else [],
        rules.removal_table.output if REMOVAL_ON else [],
        [f"{RESULTS}/figures/{name}.{ext}" for name in GRID_FIGURES for ext in ("png", "pdf")],
        rules.claims.output,
        rules.report.output,
        # every run the tables merge, extensions and replicates included: a target without
        # outputs always runs, so a finished grid that gains `seeds_at_best_lr` or extensions
        # reaches the lr_sweep checkpoint (a missing checkpoint output is otherwise rerun only
        # for a consumer whose outputs are missing)
        run_outputs("summary.json"),
        # what each round of the LR sweep settles, as soon as it does (settled_outputs)
        [settled_outputs(k) for k in range(MAX_EXTENSIONS + 1)] if SWEEP_ROUNDS else [],
