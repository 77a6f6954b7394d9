#!/usr/bin/env bash
# Create .venv and install DepthBench with pinned dependencies (CPU torch). Idempotent.
# Extras: `scripts/setup.sh test` adds what the test suite exercises (requirements-test.txt: hf,
# tracking, pretrained), `bench` transformers for the benchmarks, `slurm` the executor plugin.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install -r requirements.txt
pip install --no-deps -r requirements-nodeps.txt
pip install --no-deps --no-build-isolation -e . 2>/dev/null || pip install --no-deps -e .
for extra in "$@"; do
  pip install -r "requirements-$extra.txt"
  # an extra's packages whose declared dependencies DepthBench does not need
  [ ! -f "requirements-$extra-nodeps.txt" ] || pip install --no-deps -r "requirements-$extra-nodeps.txt"
done
# Byte-compile DepthBench now: with PYTHONDONTWRITEBYTECODE set, every workflow job would
# otherwise compile the package from source again (about 0.2 s a job).
.venv/bin/python -m compileall -q depthbench >/dev/null
.venv/bin/python -c "import torch, snakemake, depthbench; print(f'depthbench ready: torch {torch.__version__}, python {__import__(\"sys\").version.split()[0]}')"
