#!/usr/bin/env bash
#SBATCH --job-name=drpo-1.5b
#SBATCH --nodes=1
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
# DRPO on DeepSeek-R1-Distill-Qwen-1.5B, paper settings: AdamW (weight decay 0.01, constant
# LR 2e-6), 128 prompts x 8 responses per step, mini-batches of 32 prompts, 8k-token
# responses at temperature 0.6, lambda 0.1, tau 10, delta 1e-4, beta0 1e3, at least 1000 steps
# (docs/launch.md, "Steps"), save and eval every 20 steps.
#
#   sbatch slurm/drpo_1.5b.sh [extra train flags]        (from the repository root)
#   sbatch --nodes=4 --gpus-per-node=8 slurm/drpo_1.5b.sh
#   LAMBDA=0.2 sbatch slurm/drpo_1.5b.sh;  METHOD=hapo sbatch slurm/drpo_1.5b.sh
#
# Everything else is an environment variable read by slurm/launch_ray_job.sh (docs/launch.md).
set -euo pipefail
export RECIPE_NAME=${RECIPE_NAME:-drpo-1.5b}
export MODEL=${MODEL:-deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B}
export LR=${LR:-2e-6}
export ZERO_STAGE=${ZERO_STAGE:-3}
export MICRO_TRAIN_BATCH=${MICRO_TRAIN_BATCH:-4}
export MICRO_ROLLOUT_BATCH=${MICRO_ROLLOUT_BATCH:-8}

# sbatch runs a copy of this file, so the repository is found from where the job was submitted.
launcher=${DRPO_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/launch_ray_job.sh
if [[ ! -f $launcher ]]; then
  echo "cannot find $launcher: submit from the repository root or set DRPO_ROOT" >&2
  exit 1
fi
exec bash "$launcher" "$@"
