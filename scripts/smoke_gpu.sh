#!/usr/bin/env bash
# A tiny end-to-end DRPO job on ONE GPU to validate a cluster install: the offline tiny model,
# 16 toy prompts, vLLM + DeepSpeed sharing the GPU (hybrid engine, sleep modes), 2 rollout
# steps, one checkpoint; run twice, with the default KL estimate (scores pass + gradient pass)
# and with --drpo.kl_estimate microstep (the one-pass update: micro-batches of whole groups).
# Takes a few minutes; the model learns nothing, it only has to run.
#   bash scripts/smoke_gpu.sh [WORK_DIR]
set -euo pipefail
work=${1:-$(mktemp -d -t drpo-smoke-XXXX)}
mkdir -p "$work"
python - "$work" <<'PY'
import json, random, sys
from pathlib import Path
from drpo_openrlhf.tiny_model import build_tiny_model
work = Path(sys.argv[1])
build_tiny_model(work / "model")
rng = random.Random(0)
with open(work / "train.jsonl", "w") as f:
    for _ in range(16):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        prompt = f"{a}+{b}=? Let's think step by step and output the final answer within \\boxed{{}}."
        f.write(json.dumps({"prompt": prompt, "label": str(a + b)}) + "\n")
PY
ray start --head --num-gpus 1 --disable-usage-stats >/dev/null
trap 'ray stop --force >/dev/null' EXIT
for estimate in minibatch microstep; do
  python -m drpo_openrlhf.train \
    --actor.model_name_or_path "$work/model" \
    --data.prompt_dataset "$work/train.jsonl" --data.input_key prompt --data.label_key label \
    --data.apply_chat_template \
    --actor.num_nodes 1 --actor.num_gpus_per_node 1 --vllm.num_engines 1 \
    --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.3 \
    --train.colocate_all --vllm.enable_sleep --ds.enable_sleep \
    --rollout.batch_size 8 --rollout.n_samples_per_prompt 4 --rollout.max_new_tokens 64 \
    --data.max_len 192 --train.batch_size 16 --train.micro_batch_size 4 \
    --ds.zero_stage 3 --ds.param_dtype bf16 --ds.attn_implementation sdpa \
    --actor.adam.lr 1e-5 --train.num_episodes 1 \
    --ckpt.path "$work/ckpt-$estimate" --ckpt.save_steps 2 --ckpt.output_dir "$work/out-$estimate" \
    --drpo.lam 0.1 --drpo.kl_estimate "$estimate"
  test -f "$work/out-$estimate/config.json"
done
echo "smoke test passed: $work"
