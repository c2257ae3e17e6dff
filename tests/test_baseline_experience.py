"""The baselines' hook inside OpenRLHF's experience maker (driver side), on fake rollouts."""

import json
from pathlib import Path

import pytest
import torch
from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
from openrlhf.utils.config import hierarchize

from drpo_openrlhf.algo.baseline_rewards import shape_rewards
from drpo_openrlhf.algo.group_shaper import GroupRewardShaper
from drpo_openrlhf.runtime import ray_actors
from drpo_openrlhf.runtime.graceful_stop import StepTimes
from drpo_openrlhf.runtime.openrlhf_cli import openrlhf_parser
from drpo_openrlhf.sync.logprob_gap import GapLimit
from drpo_openrlhf.update.baseline_experience import (
    ShapingExperienceMaker,
    advantage_signal_stats,
    shape_experiences,
)

OPENRLHF_TRAINER = PPOTrainer.__ray_actor_class__  # the class our trainer extends

N = 4
LENGTHS = [[30, 10, 50, 20], [5, 40, 25, 60], [12, 12, 70, 8]]
CORRECT = [[1, 1, 0, 1], [0, 1, 1, 0], [1, 0, 1, 1]]


def fake_rollout(order: list[int]) -> list[Experience]:
    """Experience batches of 3 responses whose rollout indices arrive in ``order``."""
    flat_len = [x for g in LENGTHS for x in g]
    flat_ok = [x for g in CORRECT for x in g]
    batches = []
    for chunk in (order[i : i + 3] for i in range(0, len(order), 3)):
        t = 6
        batches.append(
            Experience(
                sequences=torch.ones(len(chunk), t + 1, dtype=torch.long),
                action_mask=torch.tensor([[0, 1, 1, 1, 1, 1]] * len(chunk)).bool(),
                kl=torch.zeros(len(chunk), 6),
                rewards=torch.tensor([float(flat_ok[i]) for i in chunk]),
                scores=torch.tensor([float(flat_ok[i]) for i in chunk]),
                response_length=torch.tensor([float(flat_len[i]) for i in chunk]),
                index=list(chunk),
                prompts=[f"prompt {i // N}" for i in chunk],
                info={},
            )
        )
    return batches


def maker(method: str, estimator: str, **hparams) -> ShapingExperienceMaker:
    args = hierarchize(
        openrlhf_parser().parse_args(
            ["--rollout.n_samples_per_prompt", str(N), "--algo.advantage.estimator", estimator]
        )
    )
    m = ShapingExperienceMaker.__new__(ShapingExperienceMaker)  # no Ray groups needed here
    m.strategy, m.args, m.kl_ctl = type("S", (), {"args": args})(), args, FixedKLController(0)
    m.advantage_estimator = estimator
    m.shaper = GroupRewardShaper(method, N, **hparams)
    return m


ORDER = [5, 0, 11, 2, 9, 1, 7, 3, 10, 4, 8, 6]  # completion order, groups interleaved


def test_shaping_follows_rollout_indices_not_arrival_order():
    experiences = fake_rollout(ORDER)
    shape_experiences(GroupRewardShaper("rloo_lp", N, alpha=0.2), experiences)
    expected = [
        r
        for lengths, ok in zip(LENGTHS, CORRECT, strict=True)
        for r in shape_rewards("rloo_lp", lengths, ok, alpha=0.2)
    ]
    got = {i: r for e in experiences for i, r in zip(e.index, e.rewards.tolist(), strict=True)}
    assert [got[i] for i in range(12)] == pytest.approx(expected, abs=1e-6)
    assert all(torch.equal(e.info["shaped_reward"], e.rewards) for e in experiences)


@pytest.mark.parametrize(
    ("method", "estimator", "hparams"),
    [("rloo_lp", "rloo", dict(alpha=0.2)), ("alp", "group_norm", dict(beta=1e-3))],
)
def test_openrlhfs_advantages_use_the_shaped_rewards(method, estimator, hparams):
    m = maker(method, estimator, **hparams)
    experiences = m.compute_advantages_and_returns(fake_rollout(ORDER))
    adv = {
        i: a for e in experiences for i, a in zip(e.index, e.advantages[:, 1].tolist(), strict=True)
    }
    for g, (lengths, ok) in enumerate(zip(LENGTHS, CORRECT, strict=True)):
        r = torch.tensor(shape_rewards(method, lengths, ok, **hparams))
        if estimator == "rloo":
            expected = r - (r.sum() - r) / (N - 1)
        else:  # OpenRLHF's group_norm: unbiased std + 1e-9
            expected = (r - r.mean()) / (r.std() + 1e-9)
        assert [adv[g * N + k] for k in range(N)] == pytest.approx(expected.tolist(), abs=1e-5)
    stats = advantage_signal_stats(experiences)
    flat_ok = [x for g in CORRECT for x in g]
    negative = sum(1 for i in range(12) if flat_ok[i] and adv[i] < 0)
    assert stats["rollout/frac_correct_negative_signal"] == pytest.approx(negative / sum(flat_ok))


def hand_built_trainer(experience_maker, max_steps: int | None, ckpt: Path):
    """The driver's trainer without Ray or OpenRLHF's constructor: only what its step hooks
    read (the maker, the args, no loggers, no engines, the step-times record in ``ckpt``)."""
    trainer = ray_actors._GroupAwarePPOTrainer.__new__(ray_actors._GroupAwarePPOTrainer)
    trainer.experience_maker, trainer.vllm_engines = experience_maker, []
    trainer.args = experience_maker.args
    trainer.args.ckpt.path = str(ckpt)
    trainer.args.drpo_run = type("Run", (), {"max_steps": max_steps, "verify_weight_sync": False})()
    trainer.wandb_logger = trainer.tensorboard_logger = None
    trainer._step_times = StepTimes(str(ckpt))
    trainer._gap_limit = GapLimit(None, exact_start=False)  # saved with the checkpoints
    return trainer


def test_hapo_history_across_steps_and_checkpoint(monkeypatch, tmp_path):
    first = maker("hapo", "group_norm", w=1.0)
    step1 = first.compute_advantages_and_returns(fake_rollout(ORDER))
    assert all(torch.equal(e.rewards, e.scores) for e in step1)  # no history yet: no length term
    trainer = hand_built_trainer(first, None, tmp_path)
    saved = {}
    base = OPENRLHF_TRAINER
    monkeypatch.setattr(
        base,
        "save_logs_and_checkpoints",
        lambda self, step, logs=None, states=None: saved.update(states),
    )
    trainer.save_logs_and_checkpoints(1, {}, {"global_step": 1})
    state = json.loads(json.dumps(saved[ray_actors.SHAPING_STATE]))
    assert state["history"] == {"prompt 0": 10.0, "prompt 1": 25.0, "prompt 2": 8.0}

    resumed = maker("hapo", "group_norm", w=1.0)
    trainer.experience_maker = resumed
    monkeypatch.setattr(
        base,
        "init_checkpoint_states",
        lambda self: {"global_step": 1, ray_actors.SHAPING_STATE: state},
    )
    # no engines here: their preparation at the start of fit is tests/test_engine_start.py's
    monkeypatch.setattr(ray_actors.TrainerHooks, "_prepare_engines", lambda self: None)
    trainer.init_checkpoint_states()
    step2_resumed = resumed.compute_advantages_and_returns(fake_rollout(list(range(12))))
    step2_continued = first.compute_advantages_and_returns(fake_rollout(list(range(12))))
    for a, b in zip(step2_resumed, step2_continued, strict=True):
        assert torch.equal(a.rewards, b.rewards)
    # with history, a correct response longer than the shortest one is no longer rewarded 1
    rewards = torch.cat([e.rewards for e in step2_continued])
    assert rewards[0] < 1.0 and rewards[1] > rewards[0]


def test_max_steps_stops_after_the_checkpoint_of_that_step(monkeypatch, tmp_path):
    trainer = hand_built_trainer(maker("alp", "group_norm", beta=1e-3), 3, tmp_path)
    base = OPENRLHF_TRAINER
    saved_steps = []

    def fake_fit(self, global_step=0):
        for step in range(1, 10):
            self.save_logs_and_checkpoints(step, {}, {"global_step": step})

    monkeypatch.setattr(
        base, "save_logs_and_checkpoints", lambda self, step, *a: saved_steps.append(step)
    )
    monkeypatch.setattr(base, "fit", fake_fit)
    trainer.args.eval.steps, trainer.eval_dataloader = float("inf"), None  # no evaluations
    trainer.fit()
    assert saved_steps == [1, 2, 3]


@pytest.mark.parametrize(("eval_steps", "evaluated"), [(3, [3]), (2, [2]), (1, [1, 2, 3])])
def test_max_steps_keeps_the_evaluation_of_its_last_step(
    monkeypatch, tmp_path, eval_steps, evaluated
):
    """OpenRLHF 0.11.2's ``fit`` evaluates a step after its logs and checkpoint: the stop
    after ``--drpo.max_steps`` waits for that evaluation (and the best-checkpoint check), so
    a run of 32 steps evaluated every 16 is evaluated at 16 and 32, not at 16 only."""
    trainer = hand_built_trainer(maker("alp", "group_norm", beta=1e-3), 3, tmp_path)
    base = OPENRLHF_TRAINER
    trainer.args.eval.steps, trainer.eval_dataloader = eval_steps, ["an evaluation set"]
    saved_steps, evaluated_steps = [], []

    def fake_fit(self, global_step=0):  # the order of PPOTrainer.fit's loop body
        for step in range(1, 10):
            self.save_logs_and_checkpoints(step, {}, {"global_step": step})
            if step % self.args.eval.steps == 0 and self.eval_dataloader:
                evaluated_steps.append(step)
                self.save_best_checkpoint({"eval_pass1": 0.5}, step, {"global_step": step})

    monkeypatch.setattr(
        base, "save_logs_and_checkpoints", lambda self, step, *a: saved_steps.append(step)
    )
    monkeypatch.setattr(base, "save_best_checkpoint", lambda self, *a: None)
    monkeypatch.setattr(base, "fit", fake_fit)
    trainer.fit()
    assert (saved_steps, evaluated_steps) == ([1, 2, 3], evaluated)
