import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drpo_openrlhf.algo.advantages import group_advantages


def test_grpo_by_hand():
    assert group_advantages([1, 0], "grpo") == [1.0, -1.0]
    # the paper's Section 2 example without a length penalty: every correct answer gets 1
    assert group_advantages([1, 1, 1, 0, 0, 0], "grpo") == [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
    # [3, 1, 1, 1]: mean 1.5, population std sqrt(0.75)
    s = math.sqrt(0.75)
    assert group_advantages([3, 1, 1, 1], "grpo") == pytest.approx([1.5 / s] + [-0.5 / s] * 3)


def test_rloo_by_hand():
    assert group_advantages([1, 0, 0], "rloo") == [1.0, -0.5, -0.5]
    assert group_advantages([2, 4], "rloo") == [-2.0, 2.0]


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_degenerate_groups_give_zeros(estimator):
    assert group_advantages([0.7], estimator) == [0.0]
    assert group_advantages([1, 1, 1, 1], estimator) == [0.0] * 4
    assert group_advantages([0, 0], estimator) == [0.0, 0.0]
    # equal non-representable rewards: exactly zero, not rounding noise divided by ~1e-17
    assert group_advantages([0.1, 0.1, 0.1], estimator) == [0.0] * 3


@pytest.mark.parametrize("seed", range(5))
def test_against_direct_computation(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 17))
    r = rng.normal(size=n)
    assert group_advantages(r, "grpo") == pytest.approx(list((r - r.mean()) / r.std(ddof=0)))
    loo = [r[i] - np.mean(np.delete(r, i)) for i in range(n)]
    assert group_advantages(r, "rloo") == pytest.approx(loo)


def test_tensor_list_and_array_agree():
    r = [0.3, -1.2, 2.5, 0.0]
    for estimator in ("grpo", "rloo"):
        expected = group_advantages(r, estimator)
        assert group_advantages(np.array(r), estimator) == expected
        assert group_advantages(torch.tensor(r, dtype=torch.float64), estimator) == expected


@pytest.mark.parametrize(
    ("rewards", "estimator", "match"),
    [
        ([1.0], "gae", "unknown advantage estimator"),
        ([], "grpo", "at least one reward"),
        ([1.0, float("nan")], "grpo", "finite"),
        ([1.0, float("inf")], "rloo", "finite"),
    ],
)
def test_invalid_inputs(rewards, estimator, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, estimator)


rewards_lists = st.lists(
    st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False), min_size=1, max_size=16
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(rewards_lists)
def test_advantages_sum_to_zero(r):
    for estimator in ("grpo", "rloo"):
        adv = group_advantages(r, estimator)
        scale = max(1.0, max(abs(a) for a in adv))
        assert abs(math.fsum(adv)) <= 1e-9 * scale * len(r)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(rewards_lists, st.floats(0.1, 10), st.floats(-5, 5))
def test_grpo_is_affine_invariant_and_rloo_is_scaled_grpo(r, a, b):
    if max(r) - min(r) < 1e-3:
        return  # near-constant groups are the zero case, tested above
    grpo = group_advantages(r, "grpo")
    assert group_advantages([a * x + b for x in r], "grpo") == pytest.approx(grpo, abs=1e-6)
    # rloo = n/(n-1) (r - mean) = n/(n-1) std * grpo
    n = len(r)
    std = float(np.std(r))
    expected = [n / (n - 1) * std * g for g in grpo]
    assert group_advantages(r, "rloo") == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_grpo_has_unit_population_variance():
    rnd = random.Random(0)
    r = [rnd.random() for _ in range(8)]
    adv = group_advantages(r, "grpo")
    assert math.fsum(a * a for a in adv) / len(adv) == pytest.approx(1.0)
