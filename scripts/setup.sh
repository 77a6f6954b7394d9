#!/usr/bin/env bash
# Create .venv and install DepthBench with pinned dependencies (CPU torch). Idempotent.
# `bash scripts/setup.sh [MODE ...]`: every setup installs DepthBench (editable) with the extras
# `kernels` and `pytest`, and each MODE adds the extra of that name from pyproject.toml: `test`
# what the test suite exercises (hf, tracking, pretrained, ruff), `bench` transformers for the
# benchmarks, `slurm` the executor plugin, `hf`, `tracking`, `pretrained`. All versions come from
# constraints.txt; the packages of [tool.depthbench.no-deps] (pyproject.toml) install --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# The no-deps packages of `base` and of each MODE, read from pyproject.toml; an unknown MODE stops
# here (pip would only warn about an extra it does not know).
nodeps=$(.venv/bin/python - "$@" <<'EOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy of tomli
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
extras = project["project"]["optional-dependencies"]
nodeps = project["tool"]["depthbench"]["no-deps"]
unknown = [mode for mode in sys.argv[1:] if mode not in extras]
if unknown:
    sys.exit(f"scripts/setup.sh: unknown mode {' '.join(unknown)} (modes: {' '.join(extras)})")
print(*dict.fromkeys(name for key in ["base", *sys.argv[1:]] for name in nodeps.get(key, [])))
EOF
)
extras=kernels,pytest
for mode in "$@"; do extras+=",$mode"; done
# torch, ninja and numpy first: the CPU kernels (depthbench/kernels; about 80 s of compiling the
# first time, cached afterwards) then build against them on one core while pip installs the rest,
# rather than in the first workflow job or test that needs them.
pip install -c constraints.txt torch ninja numpy
kernels_log=.venv/depthbench-kernels.log
case " $* " in *" test "*) build_tests=true ;; *) build_tests=false ;; esac
# with `test`, then the tests' counting CPU allocator (tests/cpu_memory.py), likewise
( MAX_JOBS=1 .venv/bin/python -m depthbench.kernels \
    && if $build_tests; then MAX_JOBS=1 .venv/bin/python -m tests.cpu_memory; fi ) \
  >"$kernels_log" 2>&1 &
kernels_pid=$!
trap 'kill "$kernels_pid" 2>/dev/null || true' EXIT  # a failed pip install stops the build too
# Build DepthBench with the venv's own setuptools when it meets pyproject.toml's build requirement
# (no temporary build environment; torch has brought setuptools>=77), else isolated.
isolation=--no-build-isolation
.venv/bin/python -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 68)' \
  2>/dev/null || isolation=
pip install -c constraints.txt $isolation -e ".[$extras]"
# shellcheck disable=SC2086  # one argument per package name
pip install --no-deps -c constraints.txt $nodeps
# Byte-compile DepthBench now: with PYTHONDONTWRITEBYTECODE set, every workflow job would
# otherwise compile the package from source again (about 0.2 s a job).
.venv/bin/python -m compileall -q depthbench >/dev/null
# The kernels are optional: without them (no compiler, a failed build) the models run their
# PyTorch code.
wait "$kernels_pid" || echo "setup.sh: $(tail -n 1 "$kernels_log") ($kernels_log)" >&2
.venv/bin/python -c "import torch, snakemake, depthbench; print(f'depthbench ready: torch {torch.__version__}, python {__import__(\"sys\").version.split()[0]}')"
