#!/usr/bin/env bash
# Train on one workstation (1-8 GPUs) without Slurm: the same recipe and launcher as the cluster
# jobs, with the Ray head started on this machine (127.0.0.1) and every local GPU used unless
# GPUS_PER_NODE or CUDA_VISIBLE_DEVICES says otherwise.
#
#   scripts/train_local_node.sh [1.5b|7b|8b] [extra train flags...]
#   GPUS_PER_NODE=4 LAMBDA=0.2 scripts/train_local_node.sh 1.5b
#
# Settings are the environment variables of slurm/launch_ray_job.sh (docs/launch.md).
set -euo pipefail
size=1.5b
if [[ $# -gt 0 && $1 != -* ]]; then
  size=$1
  shift
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
recipe=$repo/slurm/drpo_$size.sh
if [[ ! -f $recipe ]]; then
  echo "usage: $0 [1.5b|7b|8b] [extra train flags...] (no recipe $recipe)" >&2
  exit 2
fi
export LAUNCH_MODE=local DRPO_ROOT=$repo
exec bash "$recipe" "$@"
