"""Which prompt groups an update learns from (``algo/learnable.py``, and the baselines'
``has_relative_signal`` in ``algo/advantages.py``), held to the objective's own gradient and
to the estimators' own advantages: the rule the trainer reports and stops on is theirs."""

import itertools
import math
import random

import pytest
import torch

from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.algo.advantages import group_advantages, has_relative_signal
from drpo_openrlhf.algo.learnable import (
    group_has_signal,
    group_outcomes,
    learnable_groups,
    unlearnable_counts,
)
from drpo_openrlhf.algo.objective import drpo_loss

pytestmark = pytest.mark.usefixtures("float64_default")

# per group: correctness of its four responses (mixed, all wrong, all correct, mixed)
GROUPS = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]]
OPTIONS = list(itertools.product([False, True], repeat=2))  # keep_all_wrong, all_correct


def batch(seed: int):
    """The groups above shuffled, with random scores and distinct lengths (so that an
    all-correct group's length weights are never all equal)."""
    rng = random.Random(seed)
    rows = [(g, c) for g, flags in enumerate(GROUPS) for c in flags]
    rng.shuffle(rows)
    group_ids = torch.tensor([10 * g + 3 for g, _ in rows])  # ids need not be 0..G-1
    correct = torch.tensor([bool(c) for _, c in rows])
    scores = torch.tensor([rng.uniform(-2.0, -0.1) for _ in rows], requires_grad=True)
    lengths = torch.tensor(rng.sample(range(5, 200), len(rows)), dtype=torch.float64)
    return scores, correct, group_ids, 1 - lengths / 256


def groups_moved(scores, correct, group_ids, rewards, config: DRPOConfig) -> list[bool]:
    """Per group (sorted id order): whether the objective's gradient moves any of its scores."""
    loss = drpo_loss(
        scores, correct, group_ids, rewards, config.lam, config.tau, **config_options(config)
    )
    (grad,) = torch.autograd.grad(loss, scores)
    return [bool((grad[group_ids == g] != 0).any()) for g in torch.unique(group_ids).tolist()]


def config_options(config: DRPOConfig) -> dict[str, bool]:
    return dict(
        keep_all_wrong=config.keep_all_wrong,
        all_correct_length_signal=config.all_correct_length_signal,
    )


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lam", [0.1, math.inf])
@pytest.mark.parametrize(("keep_all_wrong", "all_correct"), OPTIONS)
def test_learnable_groups_are_those_the_objectives_gradient_moves(
    seed, lam, keep_all_wrong, all_correct
):
    config = DRPOConfig(
        lam=lam, keep_all_wrong=keep_all_wrong, all_correct_length_signal=all_correct
    )
    scores, correct, group_ids, rewards = batch(seed)
    learnable = learnable_groups(correct, group_ids, config).tolist()
    assert learnable == groups_moved(scores, correct, group_ids, rewards, config)
    # mixed always; all wrong only when kept; all correct only with a finite lambda
    assert learnable == [True, keep_all_wrong, all_correct and math.isfinite(lam), True]


def test_a_rule_that_ignores_an_option_disagrees_with_the_gradient():
    """The check above can fail: the mixed-groups-only rule misses the all-wrong groups that
    ``keep_all_wrong`` trains."""
    config = DRPOConfig(keep_all_wrong=True)
    scores, correct, group_ids, rewards = batch(0)
    has_pos, has_neg = group_outcomes(correct, group_ids)
    mixed_only = group_has_signal(has_pos, has_neg).tolist()
    assert mixed_only != groups_moved(scores, correct, group_ids, rewards, config)


def test_truth_table_and_counts():
    has_pos = torch.tensor([True, False, True])
    has_neg = torch.tensor([True, True, False])  # mixed, all wrong, all correct
    assert group_has_signal(has_pos, has_neg).tolist() == [True, False, False]
    assert group_has_signal(has_pos, has_neg, keep_all_wrong=True).tolist() == [
        True,
        True,
        False,
    ]
    on = group_has_signal(has_pos, has_neg, all_correct_length_signal=True)
    assert on.tolist() == [True, False, True]
    _, correct, group_ids, _ = batch(1)
    assert unlearnable_counts(correct, group_ids) == (1, 1)  # one all correct, one all wrong


@pytest.mark.parametrize("seed", range(20))
def test_relative_signal_is_where_either_estimator_gives_a_nonzero_advantage(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    pool = [0.0, 1.0, 0.1, 0.7 - 0.003 * rng.randint(0, 3)]
    rewards = [rng.choice(pool) for _ in range(n)]
    if rng.random() < 0.4:
        rewards = [rewards[0]] * n  # all equal, including values 0.1 that round in a mean
    for estimator in ("grpo", "rloo"):
        moved = any(a != 0 for a in group_advantages(rewards, estimator))
        assert has_relative_signal(rewards) == moved, (rewards, estimator)


def test_equal_rewards_and_a_lone_response_have_no_relative_signal():
    assert not has_relative_signal([0.1, 0.1, 0.1])
    assert not has_relative_signal([1.0])
    assert has_relative_signal([0.0, 0.0, 1e-9])
