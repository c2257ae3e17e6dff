"""A real pretrained model through the real pipeline: SmolLM2-135M-Instruct (the session's
``smollm2`` fixture, ``drpo_openrlhf/models/smollm2.py``) in ``python -m drpo_openrlhf.train`` with
the vLLM CPU engine, as ``tests/test_e2e_pipeline.py`` runs the toy models.

What a toy model cannot show: a real tokenizer and its ChatML template (the default answer
format decided from it: plain, no ``</think>``), the weight check over 30 layers and tied
embeddings (272 tensors), the honest rollout log-prob gap of a real model in the run's dtype,
and a real policy learning. One run does it all: its first update trains normally (the model
learns: its saved step-1 weights give the right answers a higher log-probability than the base
model), then the second sync loads the tied embedding with its rows reversed
(``tests/sync_break_site``) and the weight check stops the run naming it.

The prompts are sums the model gets right about half the time (measured with vLLM, 16
samples each at the pipeline's temperature 0.6: 0.5-0.7 each, 0.26 over all 81 one-digit
sums), with a system prompt and one example, without which it almost never writes
``\\boxed{}`` (2% of answers; 92% with them), so that most groups hold right and wrong answers.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_e2e_pipeline import train_env, wait_for_no_leftovers
from time_bounds import scaled
from transformers import AutoModelForCausalLM, AutoTokenizer

from drpo_openrlhf.eval.tensorboard_logs import read_scalars
from drpo_openrlhf.runtime import cpu_dtype

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SITE = Path(__file__).parent / "sync_break_site"
SYSTEM = "Answer with the result in \\boxed{}."
EXAMPLE = ("What is 2 + 2?", "2 + 2 = \\boxed{4}")
PAIRS = ((8, 3), (8, 9), (9, 1), (9, 2), (9, 3), (9, 4), (9, 8), (5, 5))
TIED = "model.embed_tokens.weight"  # also the LM head's weight
# The honest rollout log-prob gap, actor against the vLLM CPU engine in the same dtype,
# measured on this run's first rollout: bf16 0.0069-0.009 nats per token (6 runs), fp32
# 2.0e-6 (one run). 0.03 is 3x bf16's largest: a divergence between the two (a kernel, a
# dtype, RoPE) costs more (docs/cpu.md).
GAP_BOUND = 0.03
# The mean log-probability of the right answers rose by 0.59-0.64 nats after the one update
# in bf16 at lr 5e-5 (3 runs; from -1.34: the base model writes them about a quarter of the
# time at temperature 1), 0.83 in fp32 at lr 1e-5 (one run); LEARNED asks for their
# probability to rise by a factor of 1.2 at least.
LEARNED = math.log(1.2)
# One Adam step moves every weight by about the learning rate, and bf16 weights keep only the
# moves over half a bf16 step: at lr 5e-5 bf16 kept 6% of them (median relative change 7.7e-5)
# and fp32 all (2.5e-4, the right answers fell by 0.17-1.30); at 1e-5 fp32 moved 5.0e-5 and
# bf16 8.4e-6 (+0.05 only). So each dtype gets the rate that gives it the same step
# (docs/cpu.md, "bf16 or fp32: the CPU decides").
LR = {"bf16": "5e-5", "fp32": "1e-5"}[cpu_dtype.choose("auto", cpu_dtype.read_kernels())[0]]
HOLDS = r"holds other values or places than the actor's '([^']+)'"


def chat(a: int, b: int) -> list[dict[str, str]]:
    question, answer = EXAMPLE
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]


def right_answer(a: int, b: int) -> str:
    return f"{a} + {b} = \\boxed{{{a + b}}}"


def write_prompts(path: Path) -> Path:
    with path.open("w") as f:
        for a, b in PAIRS:
            f.write(json.dumps({"prompt": chat(a, b), "label": str(a + b)}) + "\n")
    return path


def train_command(model: Path, prompts: Path, out: Path, steps: int) -> list[str]:
    """8 prompts x 4 samples, one optimizer step per rollout, the same prompts each step
    (``--train.num_episodes``), the rollout temperature the pipeline defaults to; an HF copy
    of the weights after each step (``--ckpt.save_hf``, no DeepSpeed checkpoint)."""
    return [
        sys.executable,
        "-m",
        "drpo_openrlhf.train",
        *("--actor.model_name_or_path", str(model)),
        *("--data.prompt_dataset", str(prompts), "--data.input_key", "prompt"),
        *("--data.label_key", "label", "--data.apply_chat_template"),
        *("--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1"),
        *("--vllm.num_engines", "1", "--vllm.enforce_eager"),
        # vLLM's CPU worker takes this share of the NUMA node's RAM less its own footprint
        # (1.19 GiB with SmolLM2 in fp32, against 1.26 GiB requested on a 12.6 GiB node at
        # 0.1): 0.25 leaves KV cache for the run in either dtype on a node of 8 GiB or more
        *("--vllm.gpu_memory_utilization", "0.25"),
        *("--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "4"),
        *("--rollout.max_new_tokens", "64", "--data.max_len", "256"),
        *("--train.batch_size", "32", "--train.micro_batch_size", "8"),
        *("--train.num_episodes", str(steps), "--ds.attn_implementation", "sdpa"),
        *("--actor.adam.lr", LR, "--drpo.max_steps", str(steps)),
        *("--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model")),
        *("--ckpt.save_steps", "1", "--ckpt.save_hf", "--ckpt.disable_ds"),
        *("--logger.tensorboard_dir", str(out / "tb")),
    ]


@torch.no_grad()
def right_answer_logprob(model_dir: Path) -> float:
    """Mean over the prompts of the log-probability that the model writes the right answer
    (``8 + 3 = \\boxed{11}`` and its end of turn, its own format), in fp32, in one batch."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for a, b in PAIRS:
        prompt = tokenizer.apply_chat_template(
            chat(a, b), tokenize=False, add_generation_prompt=True
        )
        answer = right_answer(a, b) + tokenizer.eos_token
        rows.append((tokenizer(prompt)["input_ids"], tokenizer(answer)["input_ids"]))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):  # padded on the right: positions as without padding
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(p) + len(r)] = 1
    logprobs = model(ids, attention_mask=mask).logits.log_softmax(-1)
    total = sum(
        logprobs[i, len(p) - 1 : len(p) + len(r) - 1].gather(-1, torch.tensor(r)[:, None]).sum()
        for i, (p, r) in enumerate(rows)
    )
    return total.item() / len(rows)


def test_smollm2_learns_then_a_reversed_tied_embedding_stops_the_run(
    smollm2, tmp_path, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", str(SITE))
    monkeypatch.setenv("DRPO_TEST_SYNC_BREAK", json.dumps({"0": {"permute": TIED, "from_sync": 2}}))
    out = tmp_path / "run"
    out.mkdir()
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    with (out / "log").open("w") as log:
        done = subprocess.run(
            train_command(smollm2, prompts, out, steps=2),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=train_env(None),
            # a hang guard: 95 s alone in bf16, 316 s in fp32 with the kernels held to AVX2
            # beside other work (load 6-8); 600 s is 1.9x the latter, stretched on a slow CPU
            timeout=scaled(600),
        )
    wait_for_no_leftovers()
    output = (out / "log").read_text()
    assert done.returncode != 0, output[-3000:]

    # ChatML's generation prompt opens no <think>: the reward grades answers whole
    assert "drpo_openrlhf: answer format: plain" in output
    # step 1 trained on checked weights (the check before the first rollout and after its
    # sync passed: 272 tensors, 30 layers, the tied embedding once) ...
    assert "Global step 1:" in output and "Global step 2:" not in output
    logged = read_scalars(out / "tb")
    assert logged["train/drpo/valid_prompt_fraction"][1] > 0
    objective = logged["train/drpo/objective"][1]
    assert math.isfinite(objective) and objective != 0
    gap = logged["train/drpo/rollout_logprob_gap"][1]
    print(f"honest rollout log-prob gap: {gap:.4g} nats per token")
    assert 0 < gap < GAP_BOUND
    # ... and learned: the right answers are likelier after the update
    base, trained = (right_answer_logprob(m) for m in (smollm2, out / "ckpt" / "global_step1_hf"))
    print(f"right answers' mean log-prob: base {base:.4f}, after step 1 {trained:.4f}")
    assert trained - base > LEARNED

    # the second sync reversed the tied embedding's rows: the check names it, and only it
    breaks = [line for line in output.splitlines() if "SYNC BREAK:" in line]
    assert len(breaks) == 1 and f"{TIED} loaded with its rows reversed" in breaks[0], breaks
    assert "weight sync check failed after rollout step 2" in output, output[-3000:]
    assert "(272 tensors)" in output
    assert set(re.findall(HOLDS, output)) == {TIED}
