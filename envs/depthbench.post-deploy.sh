#!/usr/bin/env bash
# Run by Snakemake (--use-conda) inside the new environment, right after it is created from
# depthbench.yaml: the data packages that must not pull their own pins (the `base` list of
# [tool.depthbench.no-deps] in pyproject.toml, pinned in constraints.txt), with a CUDA build of
# torch also the CUDA backend's Triton kernels (the `gpu` list: Liger-Kernel, fla-core, einops;
# they run on the triton that torch brings), and DepthBench itself, which the rules' scripts
# import.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
listed() {  # the [tool.depthbench.no-deps] list of setup mode $1
  python -c 'import sys, tomllib; print(*tomllib.load(open(sys.argv[1], "rb"))["tool"]["depthbench"]["no-deps"][sys.argv[2]])' "$repo/pyproject.toml" "$1"
}
nodeps=$(listed base)
# a torch that cannot be imported stops the script here (set -e), not in the first job
cuda=$(python -c 'import torch; print(int(torch.version.cuda is not None))')
if [[ "$cuda" == 1 ]]; then
  nodeps="$nodeps $(listed gpu)"
fi
# shellcheck disable=SC2086  # one argument per package name
python -m pip install --no-deps -c "$repo/constraints.txt" $nodeps
python -m pip install --no-deps -e "$repo"
