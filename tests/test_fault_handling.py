"""The pieces of issue 23's fault handling, without a run: complete-checkpoint markers and the
resume choice, the stop message, the reward guard, the non-finite update check and the
checkpoint-path preflight. ``tests/test_faults.py`` injects the faults into real runs."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from ray.exceptions import RayTaskError
from time_bounds import within

from drpo_openrlhf.rewards.reward_guard import (
    RewardError,
    answer_problem,
    check_rollout_rewards,
    guard_reward_func,
)
from drpo_openrlhf.runtime import preflight
from drpo_openrlhf.runtime.checkpoints import (
    ASIDE,
    is_complete,
    last_checkpoint,
    mark_complete,
    prepare_resume,
    stop_message,
)
from drpo_openrlhf.update.actor_trainer import NonFiniteUpdateError, check_finite_update

# --- checkpoints ---------------------------------------------------------------------------


def save(root, step: int, *, complete: bool, latest: bool = True) -> None:
    """A checkpoint folder as DeepSpeed leaves it (two files), marked complete or not."""
    tag = root / "_actor" / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"m" * 10)
    (tag / "zero_pp_rank_0_optim_states.pt").write_bytes(b"o" * 20)
    if complete:
        mark_complete(tag)
    if latest:
        (root / "_actor" / "latest").write_text(tag.name)


def test_a_marked_checkpoint_is_complete_until_a_file_changes(tmp_path):
    save(tmp_path, 1, complete=True)
    tag = tmp_path / "_actor" / "global_step1"
    assert is_complete(tag)
    (tag / "zero_pp_rank_0_optim_states.pt").write_bytes(b"o" * 7)  # truncated
    assert not is_complete(tag)
    (tag / "zero_pp_rank_0_optim_states.pt").unlink()
    assert not is_complete(tag)


def test_resume_skips_a_checkpoint_that_latest_names_but_is_not_complete(tmp_path):
    """DeepSpeed's race: rank 0 wrote ``latest`` before another rank's shard was written."""
    save(tmp_path, 1, complete=True)
    save(tmp_path, 2, complete=False)  # latest -> global_step2
    assert last_checkpoint(str(tmp_path)) == tmp_path / "_actor" / "global_step1"
    message = prepare_resume(str(tmp_path))
    assert message.startswith(f"resuming from {tmp_path / '_actor' / 'global_step1'}")
    assert "set aside incomplete global_step2" in message
    assert (tmp_path / "_actor" / "latest").read_text() == "global_step1"
    assert not (tmp_path / "_actor" / "global_step2").exists()
    (aside,) = (tmp_path / ASIDE).iterdir()
    assert aside.name.startswith("global_step2-")


def test_resume_with_nothing_complete_starts_afresh(tmp_path):
    save(tmp_path, 1, complete=False, latest=False)
    mark_complete(tmp_path / "_actor" / "global_step1")
    (tmp_path / "_actor" / "global_step1" / "mp_rank_00_model_states.pt").unlink()
    message = prepare_resume(str(tmp_path))
    assert "no complete checkpoint" in message and "starting afresh" in message
    assert not (tmp_path / "_actor").exists()


def test_checkpoints_without_markers_resume_from_latest_as_openrlhf_does(tmp_path):
    """A checkpoint saved by OpenRLHF itself, or by an older version of this package."""
    save(tmp_path, 3, complete=False)
    assert prepare_resume(str(tmp_path)) == f"resuming from {tmp_path / '_actor' / 'global_step3'}"
    save(tmp_path / "none", 1, complete=False, latest=False)
    assert last_checkpoint(str(tmp_path / "none")) is None


def test_no_checkpoint_folder_is_a_fresh_start(tmp_path):
    assert prepare_resume(str(tmp_path / "new")).startswith("no checkpoint in")


def test_stop_message_names_the_innermost_cause_and_the_checkpoint(tmp_path):
    save(tmp_path, 4, complete=True)

    class EngineDeadError(RuntimeError):
        pass

    try:
        raise EngineDeadError("EngineCore encountered an issue.\nmore")
    except EngineDeadError as dead:
        wrapped = RayTaskError("generate", "traceback", dead)
    message = stop_message(RuntimeError("outer").with_traceback(None), None)
    assert message == "the run stopped: RuntimeError: outer. No complete checkpoint: a rerun " + (
        "starts from the beginning."
    )
    outer = RuntimeError("driver")
    outer.__cause__ = wrapped
    message = stop_message(outer, str(tmp_path))
    assert message.startswith("the run stopped: a vLLM engine process died")
    assert "(EngineDeadError: EngineCore encountered an issue.)" in message
    assert f"Last complete checkpoint: {tmp_path / '_actor' / 'global_step4'}" in message


def test_ray_s_host_memory_kill_is_not_called_a_gpu_out_of_memory():
    """Ray's OutOfMemoryError (its memory monitor, the node's RAM) and torch's (a GPU) share
    a name; each gets its own hint, also when Ray wraps torch's."""
    import ray.exceptions

    host = ray.exceptions.OutOfMemoryError("1 worker(s) were killed due to low memory")
    message = stop_message(host, None)
    assert message.startswith("the run stopped: a node ran out of host memory")
    assert "GPU" not in message
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    try:
        raise gpu
    except torch.OutOfMemoryError as raised:
        wrapped = RayTaskError("ppo_train", "traceback", raised)
    for error in (gpu, wrapped):
        assert stop_message(error, None).startswith("the run stopped: a GPU ran out of memory")


# --- rewards -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        ({"rewards": torch.tensor([1.0]), "scores": torch.tensor([1.0])}, None),
        ({"rewards": 0.0}, None),
        ([1.0], "not a dict with 'rewards'"),
        ({"scores": torch.tensor([1.0])}, "not a dict with 'rewards'"),
        ({"rewards": torch.tensor([1.0, 0.0])}, "'rewards' holds 2 values for 1 queries"),
        ({"rewards": torch.tensor([1.0]), "scores": []}, "'scores' holds 0 values"),
        ({"rewards": torch.tensor([math.nan])}, "'rewards' is not finite"),
        ({"rewards": "1"}, "'rewards' is a str"),
    ],
)
def test_answer_problems(answer, problem):
    found = answer_problem(answer, 1)
    assert found == problem if problem is None else problem in found


def test_guarded_reward_func_turns_failures_into_logged_nan(caplog):
    def raising(queries, prompts, labels):
        raise ValueError("bad label")

    def hanging(queries, prompts, labels):
        time.sleep(30)

    def fine(queries, prompts, labels):
        return {"rewards": torch.tensor([1.0]), "scores": torch.tensor([1.0])}

    assert guard_reward_func(fine, timeout=5)(["q"], ["p"], ["l"])["scores"].item() == 1.0
    for func, cause in [(raising, "ValueError: bad label"), (hanging, "within 0.5 s")]:
        # the guard's 0.5 s plus 4.5 s of slack (the hanging call returned 0.02 s past its
        # deadline, at load 6-7 on 2 cores): the slack stretches, the deadline does not
        with within(4.5, f"a guarded {func.__name__} reward call", fixed_s=0.5):
            answer = guard_reward_func(func, timeout=0.5)(["q"], ["the prompt"], ["l"])
        assert math.isnan(answer["rewards"].item()) and math.isnan(answer["scores"].item())
        assert cause in caplog.text and "'the prompt'" in caplog.text


class Sample:
    def __init__(self, rewards, scores):
        self.rewards, self.scores, self.prompts = rewards, scores, ["p"] * 2


def test_a_rollout_with_an_unscored_response_stops():
    good = Sample(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
    check_rollout_rewards([good, good])
    for bad in (Sample(None, None), Sample(torch.tensor([1.0, math.nan]), torch.ones(2))):
        with pytest.raises(RewardError, match=r"for [12] of the rollout's 4 responses"):
            check_rollout_rewards([good, bad])


# --- updates, paths ----------------------------------------------------------------------


def test_a_response_without_tokens_is_refused():
    """vLLM never returns an empty response; a hand-made rollout with one is an error, not a
    0/0 score."""
    from drpo_openrlhf.algo.scores import sequence_scores

    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="at least one token"):
        sequence_scores(torch.zeros(2, 3), mask)


def test_a_non_finite_gradient_norm_or_a_skipped_step_stops_the_run():
    check_finite_update(0.5)
    check_finite_update(None)
    for norm in (math.nan, math.inf, torch.tensor(math.nan)):
        with pytest.raises(NonFiniteUpdateError, match="before these weights are used"):
            check_finite_update(norm)
    with pytest.raises(NonFiniteUpdateError, match="skipped by DeepSpeed"):
        check_finite_update(2.37, skipped=True)  # ZeRO-1/2/3 keep the last step's norm
    with pytest.raises(NonFiniteUpdateError, match="weights it left hold NaN"):
        check_finite_update(1.0, weights_finite=False)  # fp32 ZeRO: a NaN's norm reads 1.0


NAN_STEP = """
import json, os, torch, deepspeed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed("gloo")
from drpo_openrlhf.update.actor_trainer import finite_weights
for dtype in ("fp32", "bf16"):
    for stage in (0, 1, 2, 3):
        model = torch.nn.Linear(4, 4)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
        before = finite_weights(engine.module)
        x = torch.randn(1, 4, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        engine.backward(engine(x).float().sum() * float("nan"))
        engine.step()
        norm = engine.get_global_grad_norm()
        print(json.dumps({"dtype": dtype, "stage": stage, "before": before,
                          "finite": finite_weights(engine.module),
                          "skipped": engine.skipped_steps,
                          "norm": None if norm is None else float(norm)}))
"""


def test_a_nan_step_is_seen_under_every_zero_stage_in_fp32_and_bf16(tmp_path):
    """What DeepSpeed does with a NaN gradient, from the installed DeepSpeed itself: each of
    ZeRO-0..3 in fp32 and bf16 either skips the step (``skipped_steps``) or leaves NaN weights
    that ``finite_weights`` sees (bf16 ZeRO-3 and every fp32 stage apply it, reporting a
    finite norm: 1.0 or 0.0), so ``check_finite_update`` stops every one."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    env = {**os.environ, "PORT": port, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", NAN_STEP], capture_output=True, text=True, env=env, timeout=600
    )  # a hang guard: 8 engines in 20-40 s
    assert done.returncode == 0, done.stderr[-3000:]
    cases = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 8, done.stdout
    for case in cases:
        assert case["before"], case
        with pytest.raises(NonFiniteUpdateError):
            check_finite_update(case["norm"], case["skipped"] > 0, case["finite"])
    applied = {(c["dtype"], c["stage"]) for c in cases if not c["finite"]}
    assert {("fp32", stage) for stage in range(4)} <= applied, cases  # fp32: no overflow check
    assert all(c["norm"] is None or math.isfinite(c["norm"]) for c in cases if not c["finite"])


def test_checkpoint_path_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    preflight.check_writable(str(tmp_path / "a" / "b"), "--ckpt.path")
    assert not (tmp_path / "a").exists()  # nothing created
    with pytest.raises(ValueError, match=r"--ckpt\.path .*is a file, not a directory"):
        preflight.check_writable(str(tmp_path / "file" / "ckpt"), "--ckpt.path")
