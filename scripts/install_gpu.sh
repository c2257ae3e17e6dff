#!/usr/bin/env bash
# The GPU environment on a CUDA node, in the one order that works (docs/gpu.md, section 1):
#   bash scripts/install_gpu.sh [--venv DIR] [--dry-run]      (or: make gpu-env)
# torch 2.13.0 and vLLM 0.29.0 from PyPI are CUDA 13 builds: the node needs an NVIDIA driver
# >= 580 and a CUDA 13 toolkit (nvcc), both checked before anything is installed. Then torch
# and vLLM, each loaded on the GPU; flash-attn without build isolation (its sdist imports torch
# at build time, which pip's isolation hides): a prebuilt release wheel when one matches, else
# a source build sized for this job; the rest pinned around them; this package; DeepSpeed's
# FusedAdam compiled once; an import check that runs flash-attn's and vLLM's kernels.
# Environment: PYTHON (default python3), NVIDIA_SMI and NVCC (the tools to probe; nvcc found
# as torch finds it: CUDA_HOME, PATH, /usr/local/cuda), MAX_JOBS and FLASH_ATTN_CUDA_ARCHS (a
# flash-attn source build's; default from this job's CPUs and memory and the GPUs present).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-gpu
DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
TORCH=$(grep -E '^torch==' requirements.txt)
VLLM=$(grep -E '^vllm==' requirements.txt)
FLASH_ATTN=$(grep -E '^flash-attn==' requirements.txt)
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
PINS=$(mktemp)
trap 'rm -f "$PINS"' EXIT
# every pin of requirements.txt without its extras (pip refuses extras in constraints)
grep -E '^[A-Za-z0-9_.-]+(\[[^]]*\])?==' requirements.txt | sed 's/\[[^]]*\]//' >"$PINS"
STEP=0

step() {
  STEP=$((STEP + 1))
  echo "== step $STEP: $1"
}

# Print a command; run it unless --dry-run.
run() {
  echo "   \$ $*"
  [ "$DRY_RUN" = 1 ] || "$@"
}

# Like run, then how long the command took, or that it failed and after how long.
timed() {
  local start=$SECONDS
  if run "$@"; then
    [ "$DRY_RUN" = 1 ] || echo "   done in $(elapsed "$start")"
  else
    echo "install_gpu.sh: failed after $(elapsed "$start"): $*" >&2
    exit 1
  fi
}

elapsed() {
  local s=$((SECONDS - $1))
  echo "$((s / 60)) min $((s % 60)) s"
}

check_cuda() {
  step "CUDA on this node: driver >= 580, GPUs flash-attn runs on, nvcc of CUDA 13"
  run "$PYTHON" scripts/gpu_install.py preflight || exit 1
  # the checked nvcc as CUDA_HOME, MAX_JOBS and FLASH_ATTN_CUDA_ARCHS for every build below
  echo "   \$ $PYTHON scripts/gpu_install.py build-env   (exported)"
  [ "$DRY_RUN" = 1 ] && return
  local settings line
  settings=$("$PYTHON" scripts/gpu_install.py build-env) || exit 1
  while IFS= read -r line; do
    export "${line?}"
  done <<<"$settings"
}

make_venv() {
  step "virtual environment $VENV, with flash-attn's build tools (no build isolation later)"
  [ -x "$PY" ] || run "$PYTHON" -m venv "$VENV"
  run "${PIP[@]}" install -U pip setuptools wheel packaging ninja psutil
}

install_torch() {
  step "$TORCH first (PyPI's CUDA 13 build), then torch must see a GPU and match nvcc"
  run "${PIP[@]}" install "$TORCH"
  run "$PY" scripts/gpu_install.py torch-cuda || exit 1
}

resolve_all() {
  step "the whole set resolved against the pins before more is installed (pip --dry-run)"
  run "$PY" scripts/gpu_install.py resolve requirements.txt "$PINS" || exit 1
}

install_vllm() {
  step "$VLLM (its CUDA 13 build, pinned), then its CUDA kernels must run on this GPU"
  run "${PIP[@]}" install -c "$PINS" "$VLLM"
  run "$PY" scripts/gpu_install.py vllm-cuda || exit 1
}

install_flash_attn() {
  step "$FLASH_ATTN: the release wheel matching torch/CUDA/Python/C++ ABI, else a source build"
  local choice=source
  echo "   \$ $PY scripts/gpu_install.py flash-attn"
  if [ "$DRY_RUN" = 1 ]; then
    echo "   if it prints 'wheel URL':"
    echo "   \$ ${PIP[*]} install --no-deps URL"
    echo "   if it prints 'source':"
  else
    choice=$("$PY" scripts/gpu_install.py flash-attn)
  fi
  if [ "${choice%% *}" = wheel ]; then
    timed "${PIP[@]}" install --no-deps "${choice#wheel }"
  else
    echo "   source build, 25-60 min: MAX_JOBS=${MAX_JOBS:-?} FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS:-?} CUDA_HOME=${CUDA_HOME:-?}"
    # FORCE_BUILD: no second wheel guess (flash-attn 2.8.3's own maps every CUDA >= 12 to cu12)
    timed env FLASH_ATTENTION_FORCE_BUILD=TRUE "${PIP[@]}" install --no-build-isolation --no-deps "$FLASH_ATTN"
  fi
}

install_rest() {
  step "the rest of requirements.txt, with every pin held (torch, vLLM, flash-attn as installed)"
  run env DS_BUILD_OPS=0 "${PIP[@]}" install -c "$PINS" -r requirements.txt
  # openrlhf's metadata pulls in the pynvml distribution, a deprecated shim whose import hook
  # prints a FutureWarning in every process that imports torch. The module `pynvml` comes from
  # nvidia-ml-py (requirements.txt); the shim's own, pynvml_utils, nothing here imports
  run "${PIP[@]}" uninstall -y pynvml
}

install_project() {
  step "drpo_openrlhf itself"
  run "${PIP[@]}" install --no-deps -e .
}

fused_adam() {
  step "DeepSpeed's FusedAdam compiled once (a few minutes) and loaded, not on the first step"
  run "$PY" -c "from deepspeed.ops.op_builder import FusedAdamBuilder as B; B().load()"
}

import_check() {
  step "import check of every component (versions, kernels run, and what is missing)"
  run "$PY" scripts/gpu_install.py check
}

check_cuda
make_venv
install_torch
resolve_all
install_vllm
install_flash_attn
install_rest
install_project
fused_adam
import_check
[ "$DRY_RUN" = 1 ] || echo "GPU environment ready in $VENV; next: bash scripts/smoke_gpu.sh (docs/gpu.md)"
