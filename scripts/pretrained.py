"""Snakemake entry of the pretrained-run rules (workflow/rules/pretrained.smk); logic in
depthbench.pretrained. One script for the six rules: it acts on the rule's name."""

import sys

from depthbench.pretrained import loading, stages
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
rule, spec, out = snakemake.rule, snakemake.params.spec, snakemake.output[0]  # noqa: F821
params = snakemake.params  # noqa: F821
if rule == "pretrained_convert":
    report = loading.convert(spec, out)
elif rule == "pretrained_summary":
    report = stages.write_summary(
        spec.run_id, spec.name, params.model_dir, spec.package or spec.path, out
    )
elif rule == "pretrained_sample":
    report = stages.write_sample(
        params.model_dir, params.corpus, params.settings, params.seq_len, out
    )
elif rule == "pretrained_probe":
    settings = {**params.settings, "threads": snakemake.threads}  # noqa: F821
    report = stages.run_pretrained_probes(
        spec.run_id, params.model_dir, snakemake.input.sample, out, settings
    )  # noqa: F821
elif rule == "pretrained_nll":
    settings = {**params.settings, "threads": snakemake.threads}  # noqa: F821
    report = stages.run_pretrained_nll(spec.run_id, params.model_dir, out, settings, params.window)
elif rule == "pretrained_removal":
    settings = {**params.settings, "threads": snakemake.threads}  # noqa: F821
    report = stages.run_pretrained_removal(
        spec.run_id,
        params.model_dir,
        snakemake.input.probes,
        params.corpus,
        out,  # noqa: F821
        settings,
        params.probe_settings,
        params.nll_settings,
        params.seq_len,
    )
else:
    raise ValueError(f"scripts/pretrained.py has no action for rule {rule!r}")
print(rule, report, file=sys.stderr)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
