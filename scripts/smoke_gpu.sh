#!/usr/bin/env bash
# The first run on a GPU node (docs/gpu.md): PASS/FAIL per check, non-zero exit on any FAIL,
# and a TIME line per pipeline run (step seconds, each phase's share).
# Minutes on 1-8 GPUs; the same checks run on the CPU path without one.
#   bash scripts/smoke_gpu.sh [--work DIR] [--checks env gradient sync eval penalty one-pass scores]
set -euo pipefail
exec python "$(dirname "$0")/smoke_gpu.py" "$@"
