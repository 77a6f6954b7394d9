#!/usr/bin/env bash
# Run by Snakemake (--use-conda) inside the new environment, right after it is created from
# depthbench.yaml: the data packages that must not pull their own pins (the `base` list of
# [tool.depthbench.no-deps] in pyproject.toml, pinned in constraints.txt) and DepthBench itself,
# which the rules' scripts import.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
nodeps=$(python -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["tool"]["depthbench"]["no-deps"]["base"])' "$repo/pyproject.toml")
# shellcheck disable=SC2086  # one argument per package name
python -m pip install --no-deps -c "$repo/constraints.txt" $nodeps
python -m pip install --no-deps -e "$repo"
