"""A run's training cost read back from its own tensorboard log (``eval.training_cost``):
tokens generated, wall time per phase, in-training evaluations with the tokens and time
spent until each, and the first one that reached a target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from training_logs import write_run_log

from drpo_openrlhf.eval.tensorboard_logs import read_scalars
from drpo_openrlhf.eval.training_cost import eval_accuracy, first_reaching, training_cost

# step -> (generation, log-probs, update, sync seconds, mean length, responses)
STEPS = {
    1: (6.0, 1.0, 2.5, 0.5, 40.0, 128.0),
    2: (5.0, 1.0, 2.0, 0.5, 32.0, 128.0),
    3: (4.0, 0.5, 2.0, 0.25, 24.0, 128.0),
}


def cost_of(directory: Path, datasets=None) -> dict | None:
    return training_cost(read_scalars(directory), datasets)


def test_tokens_time_and_phases_are_summed_over_the_steps(tmp_path: Path) -> None:
    write_run_log(tmp_path, STEPS)
    cost = cost_of(tmp_path)
    assert cost["steps"] == 3 and cost["missing_steps"] == []
    assert cost["tokens"] == 128 * (40 + 32 + 24)
    assert cost["seconds"] == 10 + 8.5 + 6.75
    assert cost["phases_s"] == {
        "generation": 15.0,
        "make_experience": 2.5,
        "ppo_train": 6.5,
        "broadcast": 1.25,
    }
    assert cost["evaluations"] == []


def test_each_evaluation_carries_what_was_spent_until_it(tmp_path: Path) -> None:
    """Evaluated after steps 2 and 3 on two datasources: pass@1 is their unweighted mean (the
    pass@4 tags are not pass@1), tokens and seconds are cumulative up to that step."""
    evaluations = {2: {"add2": 0.75, "add3": 0.25}, 3: {"add2": 1.0, "add3": 0.5}}
    write_run_log(tmp_path, STEPS, evaluations)
    cost = cost_of(tmp_path)
    assert cost["evaluations"] == [
        {"step": 2, "pass@1": 0.5, "tokens": 128 * 72, "seconds": 18.5},
        {"step": 3, "pass@1": 0.75, "tokens": 128 * 96, "seconds": 25.25},
    ]
    assert eval_accuracy(read_scalars(tmp_path), ["add3", "gsm8k"]) == {2: 0.25, 3: 0.5}
    assert first_reaching(cost, 0.5)["step"] == 2
    assert first_reaching(cost, 0.6)["step"] == 3
    assert first_reaching(cost, 0.8) is None


def test_steps_not_logged_are_named_and_no_log_is_none(tmp_path: Path) -> None:
    """--logger.logging_steps 2 logs every other step: the sums cover only what was logged
    and say which steps are missing."""
    write_run_log(tmp_path / "sparse", {2: STEPS[2], 4: STEPS[3]})
    cost = cost_of(tmp_path / "sparse")
    assert cost["missing_steps"] == [1, 3] and cost["steps"] == 2
    write_run_log(tmp_path / "bare", {})
    assert cost_of(tmp_path / "bare") is None


def test_a_resumed_run_counts_a_repeated_step_once(tmp_path: Path) -> None:
    """A run killed after step 2 and resumed from its step-1 checkpoint logs step 2 again:
    the later attempt's record counts, the lost one does not."""
    write_run_log(tmp_path / "a", {1: STEPS[1], 2: STEPS[2]})
    write_run_log(tmp_path / "b", {2: STEPS[3], 3: STEPS[3]})
    cost = cost_of(tmp_path)
    assert cost["tokens"] == 128 * (40 + 24 + 24)
    assert cost["seconds"] == pytest.approx(10 + 6.75 + 6.75)


def test_drpo_eval_cost_prints_each_run_s_cost(tmp_path: Path, capsys) -> None:
    from drpo_openrlhf.eval.cli import main

    write_run_log(tmp_path / "run", STEPS, {2: {"add2": 0.5}, 3: {"add2": 0.75}})
    write_run_log(tmp_path / "untimed", {})
    argv = ["cost", str(tmp_path / "run"), str(tmp_path / "untimed"), "--target", "0.6"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        str(tmp_path / "run"),
        "  3 steps, 12288 tokens, 25.2 s: generation (with grading) 59%, log-probs 10%, "
        "actor update 26%, weight sync 5%",
        "  eval at step 2: pass@1 50.0% after 9216 tokens, 18.5 s",
        "  eval at step 3: pass@1 75.0% after 12288 tokens, 25.2 s",
        "  first at or above 60.0%: step 3",
        str(tmp_path / "untimed"),
        "  no step timing logged (train/timing/step_total missing)",
    ]
    assert main(["cost", str(tmp_path / "run"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed[str(tmp_path / "run")]["tokens"] == 12288
