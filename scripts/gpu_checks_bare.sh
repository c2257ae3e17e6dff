#!/usr/bin/env bash
# DRPO's GPU checks on a machine that has CUDA torch but none of Ray, vLLM, DeepSpeed and
# OpenRLHF, and no package index (a bare GPU machine; docs/gpu.md):
# the actor-update exactness tests on CUDA (one GPU: their one-rank worlds), the device
# gradient check against fp64 (scripts/smoke_gradient.py) and the actor-update benchmark
# (scripts/bench_actor_update.py --device cuda). What needs vLLM or Ray stays in
# scripts/smoke_gpu.sh, for a real GPU node.
#   bash scripts/gpu_checks_bare.sh download   # here, with PyPI and .venv: wheels into .whl/
#   bash scripts/gpu_checks_bare.sh run [OUT [CHECK...]]  # there, .whl/ carried: logs into OUT
# CHECK: exactness, gradient, bench, bench_mb8, memory_ablation (default: all, in that order).
# The wheels are the pinned versions of what the actor path imports and that machine lacks
# (transformers too: its own is newer); its torch stays (the pin, 2.13, is not carried).
# Ray and vLLM, which OpenRLHF's actor modules import but the update never calls, are
# import-only stand-ins (tests/bare_gpu_site).
set -euo pipefail
cd "$(dirname "$0")/.."
# what the actor path imports and that machine lacks, at the versions .venv pins (DeepSpeed
# last: it is built, not downloaded)
PACKAGES=(openrlhf transformers tokenizers hjson pydantic pydantic_core annotated_types
  typing_inspection datasets dill multiprocess torchdata optree jsonlines pylatexenc
  latex2sympy2_extended antlr4-python3-runtime math-verify deepspeed)

download() {
  local platforms=() p
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
  done
  local pins
  mapfile -t pins < <(.venv/bin/python - "${PACKAGES[@]}" <<'PY'
import importlib.metadata, sys
for name in sys.argv[1:]:
    print(f"{name}=={importlib.metadata.version(name)}")
PY
  )
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform any -d .whl "${pins[@]:0:${#pins[@]}-1}"
  # DeepSpeed publishes an sdist only; its wheel is pure Python without prebuilt ops
  DS_BUILD_OPS=0 .venv/bin/pip wheel -q --no-deps --no-build-isolation "${pins[-1]}" -w .whl
}

step() {  # step NAME SECONDS CMD...: run one check, log it, go on to the next on failure
  local name=$1 limit=$2 rc=0
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"
}

run() {
  OUT=${1:-gpu-checks}
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/drpo-site .whl/*.whl
  # no flash-attn there: its stand-in lets OpenRLHF's actor module import; the checks use sdpa
  export PYTHONPATH="$PWD:$PWD/tests/bare_gpu_site:$PWD/tests/cpu_site:/tmp/drpo-site"
  export HF_HUB_OFFLINE=1 TORCHDYNAMO_DISABLE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch, transformers, deepspeed, openrlhf
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("transformers", transformers.__version__, "deepspeed", deepspeed.__version__)'
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  local steps=("${@:2}")
  [ ${#steps[@]} -gt 0 ] || steps=(exactness gradient bench bench_mb8 memory_ablation)
  for name in "${steps[@]}"; do "check_$name"; done
}

check_exactness() {
  step exactness 240 env DRPO_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -q \
    --timeout 230 tests/test_drpo_actor_exactness.py
}

check_gradient() {
  local dtype
  for dtype in bf16 fp32; do
    step "gradient_$dtype" 60 python3 scripts/smoke_gradient.py --work /tmp/sg --device cuda \
      --dtype "$dtype" --seeds 5
  done
}

check_bench() {
  step bench 300 python3 scripts/bench_actor_update.py --device cuda --repeats 2 \
    --json "$OUT/bench.json"
}

check_bench_mb8() {  # one micro-batch per group: the one-pass update and its penalty passes
  step bench_mb8 300 python3 scripts/bench_actor_update.py --device cuda --micro-batch 8 \
    --repeats 5 --json "$OUT/bench_mb8.json"
}

check_memory_ablation() {  # PPO's peak without the logits its step holds (docs/performance.md)
  step memory_ablation 150 python3 scripts/bench_actor_update.py --device cuda \
    --micro-batch 8 --repeats 1 --methods ppo --ppo-drop-logits --json "$OUT/ablation.json"
}

"$@"
