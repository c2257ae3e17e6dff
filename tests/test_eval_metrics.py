"""pass@k against brute force, AES by hand, per-dataset and averaged metrics."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drpo_openrlhf.eval import aes, pass_at_k
from drpo_openrlhf.eval.metrics import GradedSample, average_metrics, dataset_metrics


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_1_is_fraction_correct_and_pass_at_n_is_any_correct(nc: tuple[int, int]) -> None:
    n, c = nc
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    assert pass_at_k(n, c, n) == (1.0 if c > 0 else 0.0)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_aes_accuracy_up_uses_beta() -> None:
    # Length 1000 -> 600 (dL = 0.4), accuracy 0.50 -> 0.55 (dA = +0.1): 0.4 + 3 * 0.1.
    assert aes(0.55, 600, 0.50, 1000) == pytest.approx(0.7)
    # Equal accuracy counts as "not dropped": only the length term remains.
    assert aes(0.50, 600, 0.50, 1000) == pytest.approx(0.4)


def test_aes_accuracy_down_uses_gamma() -> None:
    # Length 1000 -> 600 (dL = 0.4), accuracy 0.50 -> 0.45 (dA = -0.1): 0.4 - 10 * 0.1.
    assert aes(0.45, 600, 0.50, 1000) == pytest.approx(-0.6)
    # Longer and worse: both terms negative.
    assert aes(0.40, 1200, 0.50, 1000) == pytest.approx(-0.2 - 10 * 0.2)


def test_aes_weights_are_configurable() -> None:
    assert aes(0.55, 600, 0.50, 1000, alpha=2.0, beta=1.0) == pytest.approx(0.8 + 0.1)
    assert aes(0.45, 600, 0.50, 1000, gamma=5.0) == pytest.approx(0.4 - 0.5)


def test_aes_reproduces_the_papers_7b_drpo_summary() -> None:
    # Paper: 7B DRPO cuts length 3053 -> 1502 with a 2.6% relative accuracy loss; AES 0.249.
    assert aes(0.974, 1502, 1.0, 3053) == pytest.approx(0.249, abs=1e-3)


def test_aes_needs_a_positive_reference() -> None:
    with pytest.raises(ValueError):
        aes(0.5, 100, 0.0, 100)
    with pytest.raises(ValueError):
        aes(0.5, 100, 0.5, 0)


def _s(tokens: int, correct: bool, truncated: bool = False, reason: str = "") -> GradedSample:
    return GradedSample(tokens, truncated, correct, reason or ("ok" if correct else "wrong"))


def test_dataset_metrics_by_hand() -> None:
    problems = [
        [_s(10, True), _s(20, False), _s(30, True), _s(40, False, truncated=True)],
        [_s(5, False), _s(15, False), _s(25, False), _s(35, False, reason="no_box")],
    ]
    m = dataset_metrics(problems, ks=[1, 2, 4])
    assert m["num_problems"] == 2 and m["num_samples"] == 8
    assert m["pass@1"] == pytest.approx(2 / 8)
    # Problem 1: 1 - C(2,2)/C(4,2) = 5/6; problem 2: 0.
    assert m["pass@2"] == pytest.approx((5 / 6) / 2)
    assert m["pass@4"] == pytest.approx(0.5)
    assert m["mean_length"] == pytest.approx(180 / 8)
    assert m["mean_length_correct"] == pytest.approx(20)
    assert m["mean_length_incorrect"] == pytest.approx((20 + 40 + 5 + 15 + 25 + 35) / 6)
    assert m["truncation_rate"] == pytest.approx(1 / 8)
    assert m["reasons"] == {"no_box": 1, "ok": 2, "wrong": 5}


def test_dataset_metrics_without_correct_responses() -> None:
    m = dataset_metrics([[_s(3, False), _s(5, False)]], ks=[2])
    assert m["pass@1"] == 0 and m["pass@2"] == 0
    assert m["mean_length_correct"] is None
    assert m["mean_length_incorrect"] == pytest.approx(4)


def test_average_is_unweighted_over_datasets() -> None:
    big = dataset_metrics([[_s(100, True)]] * 9 + [[_s(100, False)]], ks=[1])
    small = dataset_metrics([[_s(10, False)]], ks=[1])
    avg = average_metrics({"big": big, "small": small})
    assert avg["num_datasets"] == 2 and avg["num_problems"] == 11 and avg["num_samples"] == 11
    assert avg["pass@1"] == pytest.approx((0.9 + 0.0) / 2)
    assert avg["mean_length"] == pytest.approx(55)
    # "small" has no correct response: averaged over the datasets that have one.
    assert avg["mean_length_correct"] == pytest.approx(100)
    assert not any(math.isnan(v) for v in avg.values() if isinstance(v, float))
