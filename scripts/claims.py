"""Snakemake entry: the claims table (results/tables/claims.parquet) from the other tables."""

import sys

from depthbench.analysis.claims.table import claims_table, load_claims
from depthbench.analysis.readers import read_tables
from depthbench.analysis.tables import write_parquet
from depthbench.launch.process import exit_without_teardown

sys.stderr = open(snakemake.log[0], "a", buffering=1)  # noqa: F821
tables = read_tables({k: v for k, v in snakemake.input.items() if k != "claims"})  # noqa: F821
table = claims_table(load_claims(snakemake.input.claims), tables, snakemake.params.settings)  # noqa: F821
write_parquet(table, snakemake.output[0])  # noqa: F821
print(table[["claim_id", "verdict", "estimates"]].to_string(), file=sys.stderr)

if __name__ == "__main__":  # a Snakemake job's own process (tests run these files inside theirs)
    # skip the interpreter's teardown: 1.4-1.8 s per job (depthbench.launch.process)
    exit_without_teardown()
