#!/usr/bin/env bash
# The GPU environment on a CUDA node, in the one order that works (docs/gpu.md, section 1):
#   bash scripts/install_gpu.sh [--venv DIR] [--dry-run]      (or: make gpu-env)
# `pip install -r requirements.txt` alone fails: flash-attn's sdist imports torch at build time,
# which pip's build isolation hides. So: torch first, flash-attn without build isolation (a
# prebuilt release wheel when one matches, else a 25-60 min source build), the rest pinned
# around them, this package, DeepSpeed's FusedAdam compiled once, and an import check.
# Environment: PYTHON (default python3), TORCH_INDEX_URL (a PyTorch CUDA index, e.g.
# https://download.pytorch.org/whl/cu128; default PyPI's CUDA build), MAX_JOBS (parallel
# compile jobs of a flash-attn source build; about 9 GB of memory each), NVIDIA_SMI and NVCC
# (the tools to probe; default from PATH).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=.venv-gpu
DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) VENV=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "install_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
NVCC=${NVCC:-nvcc}
TORCH=$(grep -E '^torch==' requirements.txt)
FLASH_ATTN=$(grep -E '^flash-attn==' requirements.txt)
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
STEP=0

die() { echo "install_gpu.sh: $*" >&2; exit 1; }

step() {
  STEP=$((STEP + 1))
  echo "== step $STEP: $1"
}

# Print a command; run it unless --dry-run.
run() {
  echo "   \$ $*"
  [ "$DRY_RUN" = 1 ] || "$@"
}

check_cuda() {
  step "CUDA on this node: $NVIDIA_SMI lists a GPU, $NVCC (the toolkit) is there"
  [ "$DRY_RUN" = 1 ] && return
  command -v "$NVIDIA_SMI" >/dev/null \
    || die "no NVIDIA driver: '$NVIDIA_SMI' not found. Run this on a GPU node (e.g. inside srun --gres=gpu:1) with the driver installed."
  local gpus
  gpus=$("$NVIDIA_SMI" --query-gpu=name,driver_version --format=csv,noheader 2>&1) \
    || die "nvidia-smi failed, the driver cannot see a GPU: $gpus"
  [ -n "$gpus" ] || die "nvidia-smi lists no GPU on this node"
  echo "   GPUs: ${gpus//$'\n'/; }"
  command -v "$NVCC" >/dev/null \
    || die "no CUDA toolkit: '$NVCC' not found (DeepSpeed's FusedAdam, and flash-attn when no wheel matches, compile with it). Load it (e.g. module load cuda/12.8) or put \$CUDA_HOME/bin on PATH."
  echo "   $("$NVCC" --version | tail -1)"
}

make_venv() {
  step "virtual environment $VENV, with flash-attn's build tools (no build isolation later)"
  [ -x "$PY" ] || run "$PYTHON" -m venv "$VENV"
  run "${PIP[@]}" install -U pip setuptools wheel packaging ninja psutil
}

install_torch() {
  step "$TORCH first (the CUDA build), then torch must see a GPU"
  run "${PIP[@]}" install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH"
  run "$PY" scripts/gpu_install.py torch-cuda
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
    run "${PIP[@]}" install --no-deps "${choice#wheel }"
  else
    echo "   no matching wheel: source build, 25-60 min (MAX_JOBS=${MAX_JOBS:-auto})"
    run "${PIP[@]}" install --no-build-isolation --no-deps "$FLASH_ATTN"
  fi
}

install_rest() {
  step "the rest of requirements.txt, with $TORCH and $FLASH_ATTN held as installed"
  local pins
  pins=$(mktemp)
  printf '%s\n%s\n' "$TORCH" "$FLASH_ATTN" >"$pins"
  run env DS_BUILD_OPS=0 "${PIP[@]}" install -c "$pins" -r requirements.txt
  rm -f "$pins"
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
  step "import check of every component (versions, and what is missing)"
  run "$PY" scripts/gpu_install.py check
}

check_cuda
make_venv
install_torch
install_flash_attn
install_rest
install_project
fused_adam
import_check
[ "$DRY_RUN" = 1 ] || echo "GPU environment ready in $VENV; next: bash scripts/smoke_gpu.sh (docs/gpu.md)"
