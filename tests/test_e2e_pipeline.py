"""The product's main job end to end: ``python -m drpo_openrlhf.train`` as a subprocess, with
real Ray, a real vLLM CPU engine, the DeepSpeed actor and the math reward plugin, on a toy
model that already solves some prompts (so groups hold both correct and incorrect answers).

One local Ray cluster (fake GPUs) serves the module, as a cluster serves a user's jobs; after
every run no actor or vLLM engine process may be left. ``pytest -m e2e`` runs these alone.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from time_bounds import Deadline, scaled

from drpo_openrlhf.eval.tensorboard_logs import read_scalars
from drpo_openrlhf.process_tree import RAY_OVERRIDE_TIP

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LEFTOVER_MARKERS = ("ray::_", "EngineCore", "VLLM::")
# A toy run of 1-2 steps: 35-45 s alone on a 2-core AVX-512 machine, 2-3.5x that beside
# two busy loops, 1.8x on the AVX2 class (this module: 13.5 min against 7.5); 600 s is 2x
# the worst of those together (45 s x 3.5 x 1.8 = 284 s), before the time scale stretches it
RUN_TIMEOUT_S = 600
# Every process this pytest run starts (Ray clusters, their workers, vLLM engines) inherits
# this variable, so other runs on the same machine are not counted as this one's leftovers.
SESSION_MARK = f"DRPO_TEST_SESSION={os.getpid()}".encode()
os.environ["DRPO_TEST_SESSION"] = str(os.getpid())


def session_processes(markers=LEFTOVER_MARKERS) -> list[tuple[int, str]]:
    """(pid, command line) of this test session's processes whose command line holds one of
    ``markers``."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            mine = SESSION_MARK in (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mine and any(marker in line for marker in markers):
            found.append((int(proc.name), line.strip()))
    return found


def leftovers() -> list[str]:
    """Command lines of this session's Ray actor and vLLM engine processes still alive."""
    return [line for _, line in session_processes()]


def train_command(toy, out: Path, *flags: str, steps: int = 2) -> list[str]:
    """``python -m drpo_openrlhf.train`` on the toy task, a checkpoint every step. The toy
    policies think (``<think> ... </think>``); the Qwen2 one under a plain ChatML template,
    which ``auto`` reads as plain, so the answer format is given (a later flag overrides it)."""
    return [
        sys.executable,
        "-m",
        "drpo_openrlhf.train",
        *("--actor.model_name_or_path", str(toy["base"])),
        *("--data.prompt_dataset", str(toy["train"]), "--data.input_key", "prompt"),
        *("--data.label_key", "label", "--data.apply_chat_template"),
        *("--drpo.answer_format", "thinking"),
        *("--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1"),
        *("--vllm.num_engines", "1", "--vllm.enforce_eager"),
        *("--vllm.gpu_memory_utilization", "0.1"),
        *("--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4"),
        *("--rollout.max_new_tokens", "64", "--data.max_len", "128"),
        *("--rollout.temperature", "1.0", "--train.batch_size", "16"),
        *("--train.micro_batch_size", "8", "--ds.attn_implementation", "sdpa"),
        *("--actor.adam.lr", "1e-3", "--drpo.max_steps", str(steps)),
        *("--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "model")),
        *("--ckpt.save_steps", "1", "--logger.tensorboard_dir", str(out / "tb")),
        *flags,
    ]


def train_env(ray_address: str | None, **extra: str) -> dict[str, str]:
    """The run's environment: it joins ``ray_address``, or starts its own cluster even where
    an earlier ``ray start`` left its address file behind (``RAY_ADDRESS=local``)."""
    env = {**os.environ, "RAY_ADDRESS": ray_address or "local"}
    return {**env, **extra}


def train(toy, out: Path, *flags: str, ray_address: str | None, steps: int = 2):
    """``python -m drpo_openrlhf.train`` on the toy task; returns the finished process (its
    output in ``out/log``) once no actor or engine process of it is left."""
    command = train_command(toy, out, *flags, steps=steps)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "log").open("w") as log:
        done = subprocess.run(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=train_env(ray_address),
            timeout=scaled(RUN_TIMEOUT_S),
        )
    wait_for_no_leftovers()
    done.output = (out / "log").read_text()
    return done


def wait_for_no_leftovers(seconds: float = 60) -> None:
    """Until no process of the run is left: gone when the driver ends (0.0 s measured in 3
    runs; 3-4 s before the actors skipped their teardown), so ``seconds`` is a hang guard."""
    deadline = Deadline(seconds, "the run's processes' end after it")
    while left := leftovers():
        deadline.check(f"processes left after the run: {left}")
        time.sleep(1)


def assert_drpo_logged(tensorboard: Path, steps: int) -> dict[str, dict[int, float]]:
    """What the logs (in ``tensorboard``) of every DRPO run's steps 1..``steps`` must show: a
    real update from prompts with both correct and incorrect answers, finite objective and KL,
    vLLM sampling the actor's weights."""
    logged = read_scalars(tensorboard)
    assert sorted(logged["train/drpo/objective"]) == list(range(1, steps + 1))
    assert max(logged["train/drpo/valid_prompt_fraction"].values()) > 0
    for tag in ("train/drpo/objective", "train/drpo/kl", "train/drpo/positive_term"):
        assert all(math.isfinite(v) for v in logged[tag].values()), tag
    assert max(logged["train/drpo/rollout_logprob_gap"].values()) < 0.05
    steps_logged = list(range(1, steps + 1))
    assert sorted(logged["train/drpo/rollout_logprob_gap/engine_0"]) == steps_logged  # per engine
    return logged


def changed_tensors(model: Path, base: Path) -> list[str]:
    """Names of the base model's tensors that ``model`` holds with other values. The base is
    cast to the saved dtype first: a bf16 run saves bf16, and an fp32 base rounded to bf16 is
    not a change (compared in fp32, every tensor of an untrained run "changed")."""
    trained = load_file(model / "model.safetensors")
    before = load_file(base / "model.safetensors")
    return [n for n in before if not torch.equal(trained[n], before[n].to(trained[n].dtype))]


def assert_drpo_trained(out: Path, base: Path, steps: int) -> dict[str, dict[int, float]]:
    """What every finished DRPO run must show: its logs (``assert_drpo_logged``), the
    checkpoints and a final model that differs from the base."""
    logged = assert_drpo_logged(out / "tb", steps)
    assert (out / "ckpt" / "_actor" / f"global_step{steps}").is_dir()
    assert changed_tensors(out / "model", base)
    return logged


def optimizer_shards(out: Path, step: int) -> list[str]:
    """The DeepSpeed optimizer-state files of the step's checkpoint (ZeRO: one per rank)."""
    return sorted(
        p.name for p in (out / "ckpt" / "_actor" / f"global_step{step}").glob("*optim_states.pt")
    )


def test_drpo_two_ranks_zero2_llama_with_eval_then_resume(toy_llama, ray_address, tmp_path):
    """Two actor ranks under ZeRO-2 (first run and resume), on the 8B recipe's architecture (a
    tiny Llama: untied LM head, no biases, llama3 RoPE, grouped KV heads,
    DeepSeek-R1-Distill-Llama's chat format and BOS; tests/conftest.py), through the
    weight-sync check, evaluation, and a resume from the run's own checkpoint. The first run
    decides its answer format from that chat format (``auto``): thinking."""
    toy = toy_llama
    out = tmp_path / "run"
    two_ranks = ("--ds.zero_stage", "2", "--actor.num_gpus_per_node", "2")
    eval_flags = ("--eval.dataset", str(toy["eval"]), "--eval.steps", "1")
    auto = ("--drpo.answer_format", "auto")
    first = train(toy, out, *two_ranks, *eval_flags, *auto, ray_address=ray_address)
    assert first.returncode == 0, first.output[-3000:]
    assert "answer format: thinking (chat_template.jinja drops an earlier" in first.output
    assert "require_think_end=True bound to the reward in 1 of 1 vLLM engine(s)" in first.output
    assert RAY_OVERRIDE_TIP not in first.output  # the driver's ray.init, quiet
    # the engine runs as the actor: dtype, the rotary base and llama3 scaling, the context
    agreed = re.search(
        r"engine settings at start-up: 1 engine\(s\) run as the actor: (.*)", first.output
    )
    assert agreed and "max_model_len 128" in agreed[1], first.output[-3000:]
    assert "rope_scaling {" in agreed[1] and "rope_type: llama3" in agreed[1], agreed[1]
    logged = assert_drpo_trained(out, toy["base"], steps=2)
    # one optimizer step per rollout, at pi_old's weights: pi_old was scored in the update's
    # own micro-batches, so even in bf16 the KL estimate has no noise floor (docs/algorithm.md)
    assert set(logged["train/drpo/kl"].values()) == {0.0}, logged["train/drpo/kl"]
    evaluated = {tag: sorted(steps) for tag, steps in logged.items() if tag.startswith("eval/")}
    assert evaluated and all(s == [1, 2] for s in evaluated.values()), evaluated  # the last too
    # the untied LM head was trained and synced like every other tensor
    assert "lm_head.weight" in changed_tensors(out / "model", toy["base"])
    # two ranks trained: ZeRO-2 saved one optimizer shard per rank
    assert len(optimizer_shards(out, step=2)) == 2, optimizer_shards(out, step=2)

    resumed = train(
        toy,
        out,
        *two_ranks,
        *("--ckpt.load_enable", "--drpo.lam", "0.2"),
        ray_address=ray_address,
        steps=3,
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "Global step 3:" in resumed.output and "Global step 1:" not in resumed.output
    assert "engine settings at the resumed run's start: 1 engine(s) run as" in resumed.output
    # DeepSpeed's step-2 checkpoint (weights and optimizer state) and OpenRLHF's client state
    assert "Loading the checkpoint" in resumed.output and "'global_step': 2" in resumed.output
    assert max(read_scalars(out / "tb")["train/drpo/rollout_logprob_gap"].values()) < 0.05
    # the honest log-prob gap of step 1 went with the checkpoint; the resumed run was held to it
    assert "drpo_openrlhf: rollout log-prob gap after resuming: engine 0" in resumed.output
    assert "saved with the checkpoint" in resumed.output
    # the checkpoint carried the DRPO settings: the changed lambda is named
    assert "resuming with different DRPO settings: lam: 0.1 -> 0.2\n" in resumed.output
    assert (out / "ckpt" / "_actor" / "global_step3").is_dir()
    assert len(optimizer_shards(out, step=3)) == 2, optimizer_shards(out, step=3)


def test_drpo_zero3_one_rank_then_rloo_lp_from_the_model_it_saved(toy, ray_address, tmp_path):
    """A DRPO run with ZeRO-3 on one actor rank and the truncated sequence weight of the
    rollout correction (docs/rollout-correction.md), then an RLOO-LP baseline run (PPO on
    shaped rewards) that starts from the model the ZeRO-3 run saved: its gathered weights must
    load as a model. (DisCO's run is the sweep's, tests/test_sweep_e2e.py.)"""
    first = tmp_path / "zero3"
    correction = ("--algo.advantage.is_correction_level", "seq")
    correction += ("--algo.advantage.is_correction_mode", "clip")
    done = train(toy, first, "--ds.zero_stage", "3", *correction, ray_address=ray_address)
    assert done.returncode == 0, done.output[-3000:]
    logged = assert_drpo_trained(first, toy["base"], steps=2)
    ess = logged["train/drpo/is_ess"]  # the weights' effective sample size, a share per group
    assert sorted(ess) == [1, 2] and all(0 < v <= 1 + 1e-9 for v in ess.values()), ess

    saved = {**toy, "base": first / "model"}
    out = tmp_path / "rloo_lp"
    flags = ("--shaping.method", "rloo_lp", "--shaping.params", "alpha=0.2")
    rloo = train(saved, out, *flags, "--algo.kl.init_coef", "0", ray_address=ray_address)
    assert rloo.returncode == 0, rloo.output[-3000:]
    logged = read_scalars(out / "tb")
    assert sorted(logged["train/rollout/frac_correct_negative_signal"]) == [1, 2]
    assert all(math.isfinite(v) for v in logged["train/policy_loss"].values())
    assert max(logged["train/drpo/rollout_logprob_gap"].values()) < 0.05
    assert changed_tensors(out / "model", first / "model")


# 80 s on 2 cores beside other runs (load 2-3), of which its two steps 4 s
def test_dynamic_filtering_trains_on_learnable_groups_only(toy, ray_address, tmp_path):
    """``--algo.dynamic_filtering_enable`` under DRPO: every other prompt carries a label no
    sum has, so its group is all wrong (the toy policy also answers some prompts right every
    time); each step trains on a full rollout of groups DRPO learns from (mixed ones, by
    default), refilled from new prompts, and its line says what that took."""
    rows = [json.loads(line) for line in toy["train"].read_text().splitlines()]
    for row in rows[1::2]:
        row["label"] = "-7"
    data = tmp_path / "half_unanswerable.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    done = train(
        {**toy, "train": data}, out, "--algo.dynamic_filtering_enable", ray_address=ray_address
    )
    assert done.returncode == 0, done.output[-3000:]
    lines = re.findall(r"drpo_openrlhf: step \d+: .*", done.output)
    assert len(lines) == 2, lines
    generated = []
    for line in lines:  # a full rollout of 4 groups, all learnable
        found = re.search(r"learnable groups 4/4, filter kept 4 of (\d+) prompts", line)
        assert found, line
        generated.append(int(found[1]))
    assert sum(generated) > 8, lines  # the unanswerable prompts drawn were dropped
    logged = assert_drpo_trained(out, toy["base"], steps=2)
    assert set(logged["train/drpo/valid_prompt_fraction"].values()) == {1.0}  # mixed only
    expected = {step + 1: 1 - 4 / g for step, g in enumerate(generated)}
    assert logged["train/rollout/filtered_prompt_fraction"] == pytest.approx(expected)
    rate = {step: 100 * (1 - f) for step, f in expected.items()}  # prompts, not responses
    assert logged["train/dynamic_filtering_pass_rate"] == pytest.approx(rate)
