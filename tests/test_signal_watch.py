"""The driver's step line and the stop of a run that cannot learn (``update/signal_watch``,
``ray_actors._GroupAwarePPOTrainer._watch_signal``), on hand-built rollouts."""

from types import SimpleNamespace

import pytest
import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from test_train_cli import BASE

from drpo_openrlhf import train
from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.runtime import ray_actors
from drpo_openrlhf.runtime.checkpoints import mark_complete, stop_message
from drpo_openrlhf.update.keys import GROUP_KEY
from drpo_openrlhf.update.layout import UNTRAINED, Layout, deal_rollout
from drpo_openrlhf.update.signal_watch import (
    NoLearningSignalError,
    SignalWatch,
    format_shares,
    indicator_columns,
    percent,
    reason_shares,
    rollout_signal,
)

N = 4
REASONS = ("ok", "wrong", "no_think_end", "no_boxed")


def experience(reasons, groups, indices, truncated=None, shaped=None, split=False):
    """One experience batch as the driver sees it: 0/1 scores (``ok`` is correct), the math
    reward's ``extra_logs`` columns, DRPO's group tags and OpenRLHF's rollout indices."""
    size = len(reasons)
    info = {f"math/{name}": torch.tensor([float(r == name) for r in reasons]) for name in REASONS}
    info["math/seconds"] = torch.full((size,), 0.37)  # not a 0/1 column
    info["reward"] = torch.tensor([float(r == "ok") for r in reasons])
    info[GROUP_KEY] = torch.tensor(groups)
    if shaped is not None:
        info["shaped_reward"] = torch.tensor(shaped)
    if split:  # per-response tensors, as a split experience batch carries them
        info = {k: list(v.unbind()) for k, v in info.items()}
    return Experience(
        scores=torch.tensor([float(r == "ok") for r in reasons]),
        truncated=torch.tensor(truncated if truncated is not None else [False] * size),
        index=indices,
        info=info,
    )


def rollout(per_group: list[list[str]], truncated=None, shaped=None, split=False):
    """Two experience batches of the groups' responses (``per_group[g]``: its reasons; the
    per-response ``truncated`` and ``shaped`` rewards in the same order), the second first:
    OpenRLHF's batches need not follow the rollout order."""
    reasons = [r for group in per_group for r in group]
    groups = [g for g, group in enumerate(per_group) for _ in group]
    indices = [N * g + k for g, group in enumerate(per_group) for k in range(len(group))]
    half = len(reasons) // 2

    def cut(values, lo, hi):
        return None if values is None else values[lo:hi]

    def part(lo, hi):
        return experience(
            reasons[lo:hi],
            groups[lo:hi],
            indices[lo:hi],
            cut(truncated, lo, hi),
            cut(shaped, lo, hi),
            split,
        )

    return [part(half, len(reasons)), part(0, half)]


MIXED = [["ok", "wrong", "no_boxed", "ok"], ["wrong", "wrong", "wrong", "wrong"]]
NO_THINK_END = [["no_think_end"] * N] * 3
ALL_CORRECT = [["ok"] * N] * 2


def test_percent_never_rounds_a_rare_case_away():
    assert [percent(s) for s in (0, 0.001, 0.25, 0.996, 1)] == ["0%", "<1%", "25%", ">99%", "100%"]


def test_indicator_columns_are_the_plugins_0_1_columns_only():
    batches = rollout(MIXED)
    sizes = [b.scores.numel() for b in batches]
    columns = indicator_columns([b.info for b in batches], sizes)
    assert sorted(columns) == sorted(f"math/{name}" for name in REASONS)  # no seconds, reward
    assert columns["math/wrong"].tolist() == [1, 1, 1, 1, 0, 1, 0, 0]  # batch order
    ragged = [dict(b.info, **{"math/extra": torch.ones(1)}) for b in batches]  # one per batch
    assert "math/extra" not in indicator_columns(ragged, sizes)
    missing = [batches[0].info, {k: v for k, v in batches[1].info.items() if k != "math/ok"}]
    assert "math/ok" not in indicator_columns(missing, sizes)


def test_shares_over_all_and_over_the_wrong_responses():
    columns = {
        "math/ok": torch.tensor([1.0, 0, 0, 0]),
        "math/no_boxed": torch.tensor([0.0, 1, 1, 0]),
        "math/wrong": torch.tensor([0.0, 0, 0, 1]),
        "kk/ok": torch.zeros(4),
    }
    everyone = reason_shares(columns, torch.ones(4, dtype=torch.bool))
    assert format_shares(everyone) == "math: no_boxed 50%, ok 25%, wrong 25%"  # no kk: all 0
    wrong = reason_shares(columns, torch.tensor([False, True, True, True]))
    assert format_shares(wrong) == "math: no_boxed 67%, wrong 33%"
    assert reason_shares(columns, torch.zeros(4, dtype=torch.bool)) == {}


@pytest.mark.parametrize("split", [False, True])
def test_a_mixed_rollout_has_learnable_groups_and_a_quiet_line(split):
    signal = rollout_signal(rollout(MIXED, split=split), DRPOConfig(), N)
    assert (signal.groups, signal.learnable, signal.all_wrong, signal.all_correct) == (2, 1, 1, 0)
    line = SignalWatch(3).observe(5, signal)
    assert line == (
        "step 5: correct 25%, learnable groups 1/2 | math: wrong 62%, ok 25%, no_boxed 12%"
    )


def test_a_rollout_without_think_end_says_why_and_what_to_change():
    signal = rollout_signal(rollout(NO_THINK_END), DRPOConfig(), N)
    assert signal.without_signal and signal.all_wrong == 3
    line = SignalWatch(3).observe(1, signal)
    assert line.startswith("step 1: correct 0%, learnable groups 0/3 | math: no_think_end 100% | ")
    assert "no learning signal (1 of 3 in a row before the run stops" in line
    assert "3 of 3 groups all wrong (math: no_think_end 100%)" in line
    assert "--drpo.answer_format plain" in line
    assert "truncated" not in line


def test_truncation_comes_first_when_most_wrong_answers_were_cut():
    cut = rollout(NO_THINK_END, truncated=[True] * 12)
    diagnosis = rollout_signal(cut, DRPOConfig(), N).diagnosis()
    assert diagnosis.index("100% of them truncated: raise --rollout.max_new_tokens") < (
        diagnosis.index("--drpo.answer_format plain")
    )
    some = rollout(NO_THINK_END, truncated=[True] * 2 + [False] * 10)
    diagnosis = rollout_signal(some, DRPOConfig(), N).diagnosis()
    assert diagnosis.index("--drpo.answer_format plain") < diagnosis.index(
        "17% of them truncated"
    )  # 2 of 12


def test_all_correct_groups_point_at_harder_prompts_or_the_length_signal():
    signal = rollout_signal(rollout(ALL_CORRECT), DRPOConfig(), N)
    assert signal.without_signal and signal.all_correct == 2
    assert signal.diagnosis() == (
        "2 of 2 groups all correct: harder prompts, or --drpo.all_correct_length_signal to "
        "learn concision from them"
    )
    on = DRPOConfig(all_correct_length_signal=True)
    assert rollout_signal(rollout(ALL_CORRECT), on, N).learnable == 2
    disco = DRPOConfig(lam=float("inf"), all_correct_length_signal=True)
    assert "lambda inf" in rollout_signal(rollout(ALL_CORRECT), disco, N).diagnosis()


def test_keep_all_wrong_makes_all_wrong_groups_learnable():
    signal = rollout_signal(rollout(NO_THINK_END), DRPOConfig(keep_all_wrong=True), N)
    assert signal.learnable == 3 and not signal.without_signal


def test_baselines_count_groups_whose_shaped_rewards_differ():
    equal = rollout(NO_THINK_END, shaped=[0.0] * 12)
    signal = rollout_signal(equal, None, N, "rloo")
    assert signal.learnable == 0 and "--drpo.answer_format plain" in signal.diagnosis()
    assert (
        "all_correct_length_signal"
        not in rollout_signal(
            rollout(ALL_CORRECT, shaped=[1.0] * 8), None, N, "group_norm"
        ).diagnosis()
    )
    # ALP-like: wrong answers of different lengths get different rewards: a signal
    lengths = rollout(
        NO_THINK_END, shaped=[-0.1, -0.2, -0.1, -0.1] + [-0.3] * 4 + [-0.1] * 3 + [-0.2]
    )
    assert rollout_signal(lengths, None, N, "group_norm").learnable == 2
    # an estimator that compares across the batch: no group rule, never counted
    across = rollout_signal(equal, None, N, "reinforce")
    assert across.learnable is None and not across.without_signal
    assert "learnable groups ?/3" in SignalWatch(1).observe(1, across)


def test_the_run_stops_at_the_kth_rollout_in_a_row_and_not_before():
    watch = SignalWatch(3)
    stuck = rollout_signal(rollout(NO_THINK_END), DRPOConfig(), N)
    mixed = rollout_signal(rollout(MIXED), DRPOConfig(), N)
    for step, signal in enumerate([stuck, stuck, mixed, stuck, stuck], start=1):
        watch.observe(step, signal)
        watch.check()  # a learnable rollout in between resets the count
    assert watch.streak == 2
    watch.observe(6, stuck)
    with pytest.raises(NoLearningSignalError) as stop:
        watch.check()
    message = str(stop.value)
    assert message.startswith(
        "no prompt group to learn from in 3 rollouts in a row "
        "(--drpo.max_steps_without_signal 3; 0 turns this stop off): 3 of 3 groups all wrong"
    )
    assert "no_think_end 100%" in message and "--drpo.answer_format plain" in message
    assert "\n" not in message  # the stop line shows its first line only


def test_a_rollout_too_short_for_one_step_has_no_signal_whatever_its_groups_hold():
    # dynamic filtering out of prompts: 2 learnable-looking groups, 3 to a step
    short = rollout_signal(rollout([MIXED[0]] * 2), DRPOConfig(), N, groups_per_step=3)
    assert short.learnable == 2 and short.short and short.without_signal
    watch = SignalWatch(2)
    line = watch.observe(1, short, "filter kept 2 of 3 prompts")
    assert "learnable groups 2/2, filter kept 2 of 3 prompts" in line
    assert "no learning signal (1 of 2 in a row" in line
    assert "holds 2 prompt groups, fewer than the 3 of one optimizer step" in line
    assert "equal shaped rewards" not in line  # the baselines' reason: not this one
    watch.check()
    watch.observe(2, short)
    with pytest.raises(NoLearningSignalError, match="fewer than the 3 of one optimizer step"):
        watch.check()
    # a rollout of exactly one step's groups, or a baseline's (no step size), trains
    whole = rollout_signal(rollout([MIXED[0]] * 3), DRPOConfig(), N, groups_per_step=3)
    assert not whole.short and not whole.without_signal
    assert not rollout_signal(rollout([MIXED[0]] * 2), DRPOConfig(), N).short


@pytest.mark.parametrize("world", [1, 2, 4])
def test_short_is_exactly_when_the_deal_trains_no_response(world):
    """The driver's rule against the actor's planner: ``short`` holds exactly when the deal
    of a partial rollout leaves every response ``UNTRAINED``."""
    for groups_per_step in (1, 2, 3):
        for groups in range(1, 2 * groups_per_step + 2):
            layout = Layout(world, N, 2 * groups_per_step + 1, groups_per_step * N, 1)
            if groups_per_step * N % world:
                continue
            ids = [i // N for i in range(groups * N)]
            dealt = deal_rollout(ids, layout, allow_partial=True)
            trains = any(slot != UNTRAINED for pairs in dealt for _, slot in pairs)
            signal = rollout_signal(
                rollout([MIXED[0]] * groups), DRPOConfig(), N, groups_per_step=groups_per_step
            )
            assert signal.short == (not trains), (world, groups_per_step, groups)


def test_zero_never_stops_and_says_so():
    watch = SignalWatch(0)
    stuck = rollout_signal(rollout(NO_THINK_END), DRPOConfig(), N)
    for step in range(1, 51):
        line = watch.observe(step, stuck)
        watch.check()
    assert watch.streak == 50
    assert "no learning signal (50 in a row; --drpo.max_steps_without_signal 0: no stop)" in line


@pytest.mark.parametrize("limit", [-1, 1.5, True, "3"])
def test_a_limit_must_be_a_count(limit):
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        SignalWatch(limit)


def trainer(limit: int, method: str | None = None, groups_per_step: int = 1):
    """The driver's trainer without Ray or OpenRLHF's constructor: what ``_watch_signal``
    reads."""
    t = ray_actors._GroupAwarePPOTrainer.__new__(ray_actors._GroupAwarePPOTrainer)
    t.args = SimpleNamespace(
        drpo=DRPOConfig(),  # as launch.py sends it
        rollout=SimpleNamespace(n_samples_per_prompt=N),
        train=SimpleNamespace(batch_size=groups_per_step * N),
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator="group_norm")),
    )
    t.experience_maker = SimpleNamespace(shaper=object()) if method else SimpleNamespace()
    t._signal_watch = SignalWatch(limit)
    return t


def test_the_trainer_prints_each_step_line_and_stops_before_the_kth_update(capsys):
    t = trainer(limit=2)
    t._rollout_step = 1
    stats = t._watch_signal(rollout(NO_THINK_END))
    assert stats == {"rollout/steps_without_signal": 1.0, "rollout/learnable_group_fraction": 0.0}
    out = capsys.readouterr().out
    assert out.startswith("drpo_openrlhf: step 1: correct 0%, learnable groups 0/3 | math: ")
    t._rollout_step = 2
    with pytest.raises(NoLearningSignalError, match="in 2 rollouts in a row"):
        t._watch_signal(rollout(NO_THINK_END))
    assert "drpo_openrlhf: step 2: " in capsys.readouterr().out  # the line comes first


def test_a_baseline_trainer_uses_the_shaped_rewards(capsys):
    t = trainer(limit=1, method="rloo_lp")
    t._rollout_step = 1
    with pytest.raises(NoLearningSignalError):
        t._watch_signal(rollout(NO_THINK_END, shaped=[0.0] * 12))
    mixed = trainer(limit=1, method="rloo_lp")
    stats = mixed._watch_signal(rollout(MIXED, shaped=[0.8, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0]))
    assert stats["rollout/learnable_group_fraction"] == 0.5


def test_the_trainer_stops_a_drpo_run_whose_rollouts_fill_no_optimizer_step(capsys):
    t = trainer(limit=1, groups_per_step=3)  # --train.batch_size 12, n 4: 3 groups a step
    t._rollout_step = 1
    with pytest.raises(NoLearningSignalError, match="holds 2 prompt groups, fewer than the 3"):
        t._watch_signal(rollout(MIXED))  # 2 groups, one of them learnable
    assert "learnable groups 1/2 | " in capsys.readouterr().out
    # a baseline's update takes the rollout as it comes
    assert trainer(limit=1, method="rloo_lp", groups_per_step=3)._watch_signal(
        rollout(MIXED, shaped=[0.8, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0])
    ) == {"rollout/steps_without_signal": 0.0, "rollout/learnable_group_fraction": 0.5}


def test_the_stop_line_names_the_checkpoint_and_the_change_to_rerun_with(tmp_path):
    error = NoLearningSignalError("no prompt group to learn from in 3 rollouts in a row (...)")
    assert stop_message(error, str(tmp_path)).endswith(
        "No complete checkpoint: a rerun starts from the beginning."
    )
    folder = tmp_path / "_actor" / "global_step2"
    folder.mkdir(parents=True)
    mark_complete(folder)
    message = stop_message(error, str(tmp_path))
    assert message.startswith(
        "the run stopped: NoLearningSignalError: no prompt group to learn from in 3 rollouts"
    )
    assert message.endswith(
        f"Last complete checkpoint: {folder}; rerun with the change this line names and "
        "--ckpt.load_enable to resume from it."
    )
    # any other cause keeps the usual advice
    assert "rerun the same command" in stop_message(RuntimeError("boom"), str(tmp_path))


def test_the_flag_defaults_to_three_and_zero_turns_it_off(capsys):
    assert train.parse(BASE)[0].max_steps_without_signal == 3
    off = train.parse([*BASE, "--drpo.max_steps_without_signal", "0"])[0]
    assert off.max_steps_without_signal == 0
    with pytest.raises(SystemExit) as exit_info:
        train.parse([*BASE, "--drpo.max_steps_without_signal", "-1"])
    assert exit_info.value.code == 2
    assert "--drpo.max_steps_without_signal must be >= 0, got -1" in capsys.readouterr().err
