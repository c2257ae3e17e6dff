"""Driver-side hook for the paper's baselines: length-shaped rewards before OpenRLHF's
group advantage (GRPO = ``group_norm``, RLOO = ``rloo``).

OpenRLHF computes advantages from ``experience.rewards`` grouped by rollout index; we
replace those rewards by ``GroupRewardShaper``'s (correctness from the reward function's
0/1 ``scores``, lengths from ``response_length``) just before it does.
"""

from __future__ import annotations

import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from drpo_openrlhf.algo.group_shaper import GroupRewardShaper
from drpo_openrlhf.algo.learning_signal import signal_diagnostics
from drpo_openrlhf.rewards.reward_guard import check_rollout_rewards


def shape_experiences(shaper: GroupRewardShaper, experiences: list) -> None:
    """Overwrite ``experience.rewards`` with shaped rewards, in place.

    Responses are put in rollout order (``experience.index``), where each prompt's ``n``
    responses are consecutive, shaped group by group, and written back. The raw correctness
    stays in ``scores``; the shaped reward is also logged as ``info["shaped_reward"]``.
    """
    index = torch.tensor([i for e in experiences for i in e.index])
    order = torch.argsort(index)
    prompts = [p for e in experiences for p in e.prompts]
    lengths = torch.cat([e.response_length.float() for e in experiences])
    correct = torch.cat([e.scores for e in experiences])
    shaped_sorted = shaper.shape(
        [prompts[i] for i in order.tolist()], lengths[order], correct[order].tolist()
    )
    shaped = torch.empty(len(index), dtype=torch.float32)
    shaped[order] = torch.tensor(shaped_sorted, dtype=torch.float32)
    for experience, rewards in zip(
        experiences, shaped.split([len(e.index) for e in experiences]), strict=True
    ):
        experience.rewards = rewards.to(experience.rewards.dtype)
        experience.info["shaped_reward"] = rewards.clone()


def advantage_signal_stats(experiences: list) -> dict[str, float]:
    """The paper's diagnostic on a rollout: how often a correct response gets a negative
    advantage (group estimators give every token of a response the same advantage)."""
    signal, correct = [], []
    for e in experiences:
        first_action = e.action_mask.float().argmax(dim=-1)
        signal += e.advantages.gather(1, first_action[:, None]).squeeze(1).tolist()
        correct += e.scores.tolist()
    stats = signal_diagnostics(signal, correct)
    return {
        "rollout/frac_correct_negative_signal": stats["frac_correct_negative"],
        "rollout/mean_signal_correct": stats["mean_signal_correct"],
        "rollout/mean_signal_incorrect": stats["mean_signal_incorrect"],
    }


class ShapingExperienceMaker(RemoteExperienceMaker):
    shaper: GroupRewardShaper

    def make_experience_batch(self, rollout_samples):
        check_rollout_rewards(rollout_samples)
        return super().make_experience_batch(rollout_samples)

    def compute_advantages_and_returns(self, experiences):
        shape_experiences(self.shaper, experiences)
        return super().compute_advantages_and_returns(experiences)
