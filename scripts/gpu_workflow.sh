#!/usr/bin/env bash
# The whole workflow (README command 1's Snakemake run) on one machine with a GPU, no package
# registry and little time, from a bundle prepared on a CPU machine. Three steps:
#
#   bash scripts/gpu_workflow.sh wheels  [DIR]            # online, any machine: DIR (.gpu/wheels)
#       the pure-Python (and, where none exists, cp312 manylinux) wheels of Snakemake, submitit,
#       jsonschema and everything they need, and of Liger-Kernel and fla-core (the CUDA backend's
#       HC, mHC and MoDA kernels; pyproject.toml's no-deps `gpu` list), at constraints.txt's
#       versions, for Python 3.12
#   bash scripts/gpu_workflow.sh prepare [CONFIG] [DIR]   # CPU: DIR/prepared.tar.gz (.gpu)
#       the workflow's own outputs that need no GPU (tokenizer, token shards, tokenized NLL sets)
#       and Snakemake's metadata of them, made in a scratch copy of the workflow
#   bash scripts/gpu_workflow.sh run [--config CONFIG] [--bundle DIR] [--out DIR]
#                                   [--device cuda|cpu] [--cores N] [--slots K] [--time-limit S]
#       installs DIR/wheels into a private folder (the interpreter's own packages, torch among
#       them, untouched), unpacks the prepared outputs and checks with a dry run that Snakemake
#       takes them as up to date, runs the workflow with train.device set to --device (no silent
#       fall-back to the CPU), then leaves in --out: record.json (per-job times and devices,
#       per-run losses and tokens/s, the claims; depthbench.commands.workflow_record),
#       headline.png, report.html, snakemake.log and results.tar.gz (tables, figures, logs,
#       benchmark records, run summaries). The record is written also when a job failed, and
#       --time-limit S interrupts Snakemake (SIGINT) after S seconds so that it is written before
#       an outer limit kills everything. On CUDA, runs whose training failed are trained again
#       with train.compile: none and train.kernels: reference in the time left (the record gives
#       each run's settings).
#
# CONFIG defaults to config/presets/gpu_smoke.yaml; PYTHON to .venv/bin/python where it exists,
# else python3. The CPU test (tests/workflow/test_gpu_workflow.py) runs the same `prepare` and
# `run` on a tiny grid with --device cpu --cores 2. docs/design/workflow.md says why.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
[[ "$PYTHON" != */* || "$PYTHON" = /* ]] || PYTHON="$REPO/$PYTHON"  # the steps change directory
PRESET=config/presets/gpu_smoke.yaml
die() { echo "gpu_workflow: $*" >&2; exit 1; }
abspath() { [[ "$1" = /* ]] && echo "$1" || echo "$REPO/$1"; }

wheels() {
  local dir; dir="$(abspath "${1:-.gpu/wheels}")"
  mkdir -p "$dir"
  # the requirement closure of what the image lacks, at the versions this checkout's setup pins
  local pins; pins="$(PYTHONPATH="$REPO" "$PYTHON" -m depthbench.commands.gpu_bundle pins)"
  # and the gpu mode's packages installed without their dependencies (Liger-Kernel, fla-core)
  pins="$pins $(PYTHONPATH="$REPO" "$PYTHON" -m depthbench.commands.gpu_bundle pins-no-deps)"
  local platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  for pin in $pins; do
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${platforms[@]}" -d "$dir" "$pin" 2>/dev/null \
      || "$PYTHON" -m pip wheel -q --no-deps -w "$dir" "$pin"  # an sdist: pure Python here
  done
  echo "$dir: $(ls "$dir" | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
}

prepare() {
  local config dir stage
  config="$(abspath "${1:-$PRESET}")"; dir="$(abspath "${2:-.gpu}")"
  stage="$(mktemp -d)"; trap 'rm -rf "$stage"' RETURN
  cp -R Snakefile workflow scripts config slurm envs "$stage/"
  (cd "$stage" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m snakemake \
    --cores 2 --configfile "$config" --until tokenize nll_sets)
  PYTHONPATH="$REPO" "$PYTHON" -m depthbench.commands.gpu_bundle pack "$stage" "$dir/prepared.tar.gz"
}

run() {
  local config="$PRESET" bundle="" out="results/gpu_run" device=cuda cores slots="" limit=0
  cores="$(nproc)"
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --config) config="$2"; shift 2 ;;
      --bundle) bundle="$(abspath "$2")"; shift 2 ;;
      --out) out="$2"; shift 2 ;;
      --device) device="$2"; shift 2 ;;
      --cores) cores="$2"; shift 2 ;;
      --slots) slots="$2"; shift 2 ;;
      --time-limit) limit="$2"; shift 2 ;;
      *) die "unknown option $1 (valid: --config --bundle --out --device --cores --slots --time-limit)" ;;
    esac
  done
  [[ "$device" == cuda || "$device" == cpu ]] || die "--device $device: valid: cuda, cpu"
  [[ -f "$config" ]] || die "--config $config: no such file"
  # at most 6 jobs on one GPU at a time (each its own CUDA context); on the CPU one per core
  [[ -n "$slots" ]] || { [[ "$device" == cuda ]] && slots=6 || slots="$cores"; }
  out="$(abspath "$out")"; mkdir -p "$out"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  if [[ -n "$bundle" && -d "$bundle/wheels" ]]; then
    local site="${DEPTHBENCH_SITE:-/tmp/depthbench-site}"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$bundle"/wheels/*.whl
    export PYTHONPATH="$REPO:$site"
    "$PYTHON" -m depthbench.commands.gpu_bundle check-wheels "$site" \
      || die "the wheels in $bundle/wheels need what this interpreter lacks (above)"
  fi
  "$PYTHON" - "$device" <<'EOF' || die "this interpreter cannot run the workflow (above)"
import importlib.util, sys
need = ["torch", "snakemake", "submitit", "jsonschema", "yaml", "tokenizers", "safetensors",
        "numpy", "pandas", "pyarrow", "matplotlib", "scipy", "tqdm"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing modules: {missing} (carry their wheels: bash scripts/gpu_workflow.sh wheels)")
import torch
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("--device cuda but torch sees no CUDA device")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"device {torch.cuda.get_device_name(0) if sys.argv[1] == 'cuda' else 'cpu'}")
EOF
  local smk=("$PYTHON" -m snakemake --configfile "$config")
  if [[ -n "$bundle" && -f "$bundle/prepared.tar.gz" ]]; then
    "$PYTHON" -m depthbench.commands.gpu_bundle unpack "$bundle/prepared.tar.gz" "$REPO"
    local dry
    dry="$("${smk[@]}" -n --cores 1 --until tokenize nll_sets 2>&1)" || { echo "$dry"; die "dry run failed"; }
    # a planned job of the prepare step's rules (the Job stats table) means an output to redo
    ! grep -Eq "^(tokenizer|tokenize|tokenize_index|tokenize_piece|nll_sets) +[0-9]+$" <<<"$dry" || {
      echo "$dry"; die "the prepared outputs are not up to date for $config (the jobs above would redo them)"; }
    echo "gpu_workflow: the prepared tokenizer, shards and NLL sets are up to date"
  fi
  local start rc=0 begin="$SECONDS"
  start="$(date +%s.%N)"
  set +e
  timeout -s INT -k 60 "$limit" "${smk[@]}" --cores "$cores" --resources dispatch_slots="$slots" --keep-going \
    --rerun-incomplete --config "train={device: $device}" 2>&1 | tee "$out/snakemake.log"
  rc="${PIPESTATUS[0]}"
  # a training job that failed with compile and the Triton kernels on (the GPU-only code paths
  # the CPU test cannot reach) is trained again with neither, in the time left: both settings are
  # operational (not in the run ids), so only the failed runs train; each run's summary records
  # its settings
  local left=$((limit > 0 ? limit - ${SECONDS} + begin : 0))
  if [[ "$rc" != 0 && "$rc" != 124 && "$device" == cuda ]] && grep -q "^Error in rule train" "$out/snakemake.log" \
    && ((limit == 0 || left > 90)); then
    echo "gpu_workflow: training failed (above); training those runs again with train.compile: none, train.kernels: reference"
    timeout -s INT -k 60 "$left" "${smk[@]}" --cores "$cores" --resources dispatch_slots="$slots" \
      --keep-going --rerun-incomplete --config "train={device: $device, compile: none, kernels: reference}" 2>&1 \
      | tee -a "$out/snakemake.log"
    rc="${PIPESTATUS[0]}"
  fi
  set -e
  local wall; wall="$("$PYTHON" -c "import time; print(round(time.time() - $start, 1))")"
  local name; name="$("$PYTHON" -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['name'])" "$config")"
  local prepared=""; [[ -n "$bundle" && -f "$bundle/prepared.tar.gz" ]] && prepared=tokenizer,tokenize,tokenize_index,tokenize_piece,nll_sets
  "$PYTHON" -m depthbench.commands.workflow_record results "$out/record.json" --name "$name" \
    --command "bash scripts/gpu_workflow.sh run --config $config --device $device --cores $cores --slots $slots" \
    --wall-seconds "$wall" --prepared "$prepared"
  for f in results/figures/headline.png results/report.html; do [[ -f "$f" ]] && cp "$f" "$out/"; done
  tar czf "$out/results.tar.gz" --exclude='*.bin' --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='results/gpu_run' --exclude='results/.cache' --exclude="$(basename "$out")" \
    results/tables results/figures results/logs results/benchmarks results/runs results/work \
    2>/dev/null || true
  echo "gpu_workflow: snakemake exit $rc after ${wall} s; results in $out"
  return "$rc"
}

case "${1:-}" in
  wheels) shift; wheels "$@" ;;
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) die "usage: bash scripts/gpu_workflow.sh wheels [DIR] | prepare [CONFIG] [DIR] | run [options]" ;;
esac
