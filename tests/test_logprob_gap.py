"""The rollout/actor log-prob gap: pooled over batches, masked, and refused when far off, with
a limit derived from the honest gap the run measures itself."""

from types import SimpleNamespace

import pytest
import torch

from drpo_openrlhf.algo.logprob_gap import (
    FALLBACK_LIMIT,
    MIN_LIMIT,
    GapLimit,
    derived_limit,
    logprob_gap,
    pooled_gap,
    probe_gap,
)


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

    fixed = GapLimit(0.5, exact_start=True)
    stats = rollout_logprob_stats([experience(0.01), experience(0.03)], fixed)
    assert stats["drpo/rollout_logprob_gap"] == pytest.approx(0.02)
    assert stats["drpo/rollout_logprob_gap_max"] == pytest.approx(0.03)
    assert stats["drpo/rollout_logprob_gap_limit"] == 0.5
    with pytest.raises(LogprobGapError, match="broken weight sync"):
        rollout_logprob_stats([experience(2.0)], fixed)
    no_logprobs = SimpleNamespace(rollout_log_probs=None)
    assert rollout_logprob_stats([no_logprobs], fixed) == {}

    derived = GapLimit(None, exact_start=True)  # honest 0.02 at the first rollout: limit 0.2
    assert rollout_logprob_stats([experience(0.02)], derived)[
        "drpo/rollout_logprob_gap_limit"
    ] == pytest.approx(0.2)
    rollout_logprob_stats([experience(0.15)], derived)
    with pytest.raises(LogprobGapError, match=r"limit 0\.2, honest gap 0\.02"):
        rollout_logprob_stats([experience(0.25)], derived)


def test_gap_limit_is_derived_from_the_first_exactly_checked_rollout():
    limit = GapLimit(None, exact_start=True)
    value, line = limit.limit_for(0.003)  # a GPU's honest gap, say
    assert value == pytest.approx(0.03) and "honest rollout log-prob gap 0.003" in line
    assert limit.limit_for(0.5) == (pytest.approx(0.03), None)  # measured once, kept
    assert GapLimit(None, exact_start=True).limit_for(0.0)[0] == MIN_LIMIT
    assert derived_limit(1e-4) == MIN_LIMIT and derived_limit(0.1) == pytest.approx(1.0)
    # weights not checked: the first rollout may already be stale, so it sets nothing
    unchecked = GapLimit(None, exact_start=False)
    assert unchecked.limit_for(0.04) == (FALLBACK_LIMIT, None) and unchecked.honest is None
    assert GapLimit(0.2, exact_start=True).limit_for(0.001) == (0.2, None)


def test_probe_gap_compares_token_by_token():
    assert probe_gap([-1.0, -2.0, -0.5], [-1.1, -2.0, -0.2]) == pytest.approx((0.4 / 3, 0.3))
    with pytest.raises(ValueError, match="probe log-probs of 2 and 3 tokens"):
        probe_gap([-1.0, -2.0], [-1.0, -2.0, -3.0])
