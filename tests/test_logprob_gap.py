"""The rollout/actor log-prob gap: pooled over batches, masked, and refused when far off."""

from types import SimpleNamespace

import pytest
import torch

from drpo_openrlhf.algo.logprob_gap import logprob_gap, pooled_gap


def test_gap_counts_only_action_tokens():
    rollout = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    actor = torch.tensor([[-1.1, -1.8, 0.0], [-0.5, -0.7, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    mean, largest, count = logprob_gap(rollout, actor, mask)
    assert count == 5
    assert mean == pytest.approx((0.1 + 0.2 + 0.0 + 0.2 + 0.0) / 5)
    assert largest == pytest.approx(0.2)


def test_pooled_gap_weights_batches_by_tokens():
    assert pooled_gap([(1.0, 2.0, 1), (0.0, 0.5, 3)]) == pytest.approx((0.25, 2.0))
    assert pooled_gap([(0.0, 0.0, 0)]) == (0.0, 0.0)


def test_gap_rejects_misaligned_tensors():
    with pytest.raises(ValueError, match="differ in shape"):
        logprob_gap(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_rollout_stats_fail_loudly_on_a_broken_sync():
    from drpo_openrlhf.integration.ray_actors import LogprobGapError, rollout_logprob_stats

    def experience(gap: float):
        actor = torch.full((2, 4), -1.0)
        return SimpleNamespace(
            rollout_log_probs=actor + gap, action_log_probs=actor, action_mask=torch.ones(2, 4)
        )

    stats = rollout_logprob_stats([experience(0.01), experience(0.03)], max_gap=0.5)
    assert stats["drpo/rollout_logprob_gap"] == pytest.approx(0.02)
    assert stats["drpo/rollout_logprob_gap_max"] == pytest.approx(0.03)
    with pytest.raises(LogprobGapError, match="broken weight sync"):
        rollout_logprob_stats([experience(2.0)], max_gap=0.5)
    no_logprobs = SimpleNamespace(rollout_log_probs=None)
    assert rollout_logprob_stats([no_logprobs], max_gap=0.5) == {}
