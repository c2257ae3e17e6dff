import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drpo_openrlhf.algo.advantages import group_advantages
from drpo_openrlhf.algo.baseline_rewards import (
    METHODS,
    laser_d_bucket_targets,
    laser_d_difficulty,
    laser_d_target_length,
    resolve_hparams,
    shape_rewards,
)

# Appendix table tab:advan: one group of ten responses, eight correct.
LENGTHS = [1500, 1200, 1900, 2200, 2800, 2000, 3600, 6400, 1300, 1200]
CORRECT = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
# method -> (hyper-parameters, estimator, printed rewards, printed advantages)
PAPER_ROWS = {
    "rloo_lp": (
        {"alpha": 0.4},
        "rloo",
        [0.87, 0.89, 0.85, 0.83, 0.79, 0.84, 0.74, 0.63, 0.0, 0.0],
        [0.25, 0.27, 0.23, 0.21, 0.16, 0.22, 0.11, -0.02, -0.72, -0.72],
    ),
    "alp": (
        {"beta": 0.0001},
        "grpo",
        [0.88, 0.9, 0.85, 0.82, 0.78, 0.84, 0.71, 0.49, -0.1, -0.1],
        [0.74, 0.8, 0.65, 0.58, 0.46, 0.63, 0.28, -0.32, -1.92, -1.9],
    ),
    "hapo": (
        {"w": 1.0, "c": -0.7, "h": 1200},
        "grpo",
        [0.62, 1.0, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, -0.13, -0.0],
        [0.99, 2.29, -0.1, -0.1, -0.1, -0.1, -0.1, -0.1, -1.57, -1.12],
    ),
    "l1_max": (
        {"alpha": 0.0003, "target_length": 4000, "delta": 0.5},
        "grpo",
        [1.0, 1.0, 1.0, 1.0, 0.86, 1.0, 0.62, 0.0, 0.0, 0.0],
        [0.8, 0.8, 0.8, 0.8, 0.48, 0.8, -0.06, -1.48, -1.48, -1.48],
    ),
    "shorter_better": (
        {"alpha": 2.0, "beta": 0.001},
        "grpo",
        [1.7, 2.0, 1.3, 1.0, 0.4, 1.2, -0.4, -3.2, -0.1, 0.0],
        [0.92, 1.14, 0.64, 0.43, 0.01, 0.57, -0.56, -2.53, -0.35, -0.28],
    ),
    "laser_d": (
        {"alpha": 0.5, "target_length": 4000},
        "grpo",
        [1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.0, 0.0, 0.0],
        [0.59, 0.59, 0.59, 0.59, 0.59, 0.59, 0.59, -0.25, -1.94, -1.94],
    ),
}
PRINTED = 0.005 + 1e-9  # two printed decimals


def close_to_printed(values, printed):
    return all(abs(v - p) <= PRINTED for v, p in zip(values, printed, strict=True))


@pytest.mark.parametrize("method", METHODS)
def test_paper_table_rewards(method):
    hparams, _, printed_rewards, _ = PAPER_ROWS[method]
    rewards = shape_rewards(method, LENGTHS, CORRECT, **hparams)
    assert close_to_printed(rewards, printed_rewards)


@pytest.mark.parametrize("method", METHODS)
def test_paper_table_advantages(method):
    hparams, estimator, _, printed = PAPER_ROWS[method]
    adv = group_advantages(shape_rewards(method, LENGTHS, CORRECT, **hparams), estimator)
    if method == "rloo_lp":
        # The 8th entry is printed -0.02 but the formula gives -0.0129: the table computed
        # it from its rounded rewards (checked below). Same sign, so the same conclusion.
        assert adv[7] == pytest.approx(-0.012947, abs=1e-6)
        assert round(group_advantages(PAPER_ROWS[method][2], "rloo")[7], 2) == -0.02
        adv, printed = adv[:7] + adv[8:], printed[:7] + printed[8:]
    assert close_to_printed(adv, printed)


def test_section2_example_rloo_lp_with_grpo_flips_the_third_correct_response():
    # Section 2 / Figure 1: alpha = 1, population std, GRPO advantages.
    lengths, correct = [2000, 2500, 4000, 2800, 3800, 3200], [1, 1, 1, 0, 0, 0]
    rewards = shape_rewards("rloo_lp", lengths, correct, alpha=1.0)
    assert close_to_printed(rewards, [0.73, 0.6, 0.2, 0, 0, 0])
    assert round(group_advantages(rewards, "grpo")[2], 2) == -0.17
    assert group_advantages(correct, "grpo")[2] == pytest.approx(1.0)


# --- each formula by hand -------------------------------------------------------------


def test_rloo_lp_by_hand():
    # correct lengths 100 and 300: mean 200, population std 100, z = -1 and +1
    r = shape_rewards("rloo_lp", [100, 300, 50], [1, 1, 0], alpha=0.2)
    sig = 1 / (1 + math.e)  # sigmoid(-1)
    assert r == pytest.approx([1 - 0.2 * sig, 1 - 0.2 * (1 - sig), 0.0])


def test_rloo_lp_degenerate_groups():
    assert shape_rewards("rloo_lp", [10, 20], [0, 0], alpha=0.4) == [0.0, 0.0]
    # one correct response, or tied correct lengths: z = 0, sigmoid 1/2
    assert shape_rewards("rloo_lp", [10], [1], alpha=0.4) == [pytest.approx(0.8)]
    assert shape_rewards("rloo_lp", [7, 7, 3], [1, 1, 0], alpha=0.4) == pytest.approx(
        [0.8, 0.8, 0.0]
    )
    # equal non-integer lengths must not produce rounding-noise z-scores
    assert shape_rewards("rloo_lp", [0.1, 0.1, 0.1], [1, 1, 1], alpha=0.4) == pytest.approx(
        [0.8] * 3
    )


def test_rloo_lp_extreme_lengths_do_not_overflow():
    r = shape_rewards("rloo_lp", [0, 1e6, 1e6 + 1], [0, 1, 1], alpha=0.5)
    assert r[0] == 0.0 and r[1] > r[2]


def test_alp_by_hand():
    # solve rate 1/2, beta 0.01: penalty 0.005 per token on every response
    assert shape_rewards("alp", [100, 200, 40, 60], [1, 1, 0, 0], beta=0.01) == pytest.approx(
        [0.5, 0.0, -0.2, -0.3]
    )
    # all wrong: the solve rate is floored at 1/K, K = group size by default
    assert shape_rewards("alp", [100, 200], [0, 0], beta=0.01) == pytest.approx([-0.5, -1.0])
    assert shape_rewards("alp", [100, 200], [0, 0], beta=0.01, K=4) == pytest.approx([-0.25, -0.5])
    # all correct: full rate
    assert shape_rewards("alp", [100, 200], [1, 1], beta=0.001) == pytest.approx([0.9, 0.8])
    assert shape_rewards("alp", [100], [1], beta=0.0) == [1.0]


def test_hapo_by_hand():
    h = 100
    lengths = [50, 100, 130, 150, 200, 400]
    r = shape_rewards("hapo", lengths, [1] * 6, h=h)
    cos = [math.cos(math.pi / 2 * n / h) for n in (50, 100, 130)]
    # beyond 2h the cosine is held at cos(pi) = -1; the cut-off -0.7 lifts it
    assert r == pytest.approx([1 + cos[0], 1 + cos[1], 1 + cos[2], 0.3, 0.3, 0.3])
    wrong = shape_rewards("hapo", lengths, [0] * 6, h=h, w=0.5)
    # shorter-than-h wrong answers are not penalised; longer ones are, down to -w
    expected = [0.0, 0.0, 0.5 * cos[2], 0.5 * math.cos(0.75 * math.pi), -0.5, -0.5]
    assert wrong == pytest.approx(expected, abs=1e-12)


def test_hapo_without_history_has_no_length_term():
    assert shape_rewards("hapo", [10, 9999, 5], [1, 1, 0], h=None) == [1.0, 1.0, 0.0]


def test_l1_max_by_hand():
    r = shape_rewards(
        "l1_max", [500, 1000, 1400, 2000, 10], [1, 1, 1, 1, 0], alpha=0.001, target_length=1000
    )
    assert r == pytest.approx([1.0, 0.5, 0.1, 0.0, 0.0])


def test_shorter_better_by_hand():
    # SOL = shortest correct length = 100
    r = shape_rewards("shorter_better", [100, 150, 90, 400], [1, 1, 0, 0], alpha=1.0, beta=0.01)
    assert r == pytest.approx([1.0, 0.5, -0.1, -3.0])
    # none correct: SOL = mean length = 200
    r = shape_rewards("shorter_better", [100, 300], [0, 0], alpha=1.0, beta=0.01)
    assert r == pytest.approx([-1.0, -1.0])
    # ties at the shortest correct length both get the full correctness reward
    assert shape_rewards("shorter_better", [80, 80], [1, 1], alpha=2.0) == [2.0, 2.0]


def test_laser_d_by_hand():
    r = shape_rewards("laser_d", [100, 101, 50, 500], [1, 1, 0, 0], alpha=0.5, target_length=100)
    assert r == [1.5, 1.0, 0.0, 0.0]  # the target itself still earns the bonus


def test_single_response_groups():
    for method, (hparams, *_) in PAPER_ROWS.items():
        assert len(shape_rewards(method, [1000], [1], **hparams)) == 1
        assert len(shape_rewards(method, [1000], [0], **hparams)) == 1


def test_published_defaults():
    assert resolve_hparams("hapo", {"h": 5}) == {"w": 1.0, "c": -0.7, "h": 5.0}
    assert resolve_hparams("l1_max", {"target_length": 4000}) == {
        "alpha": 0.0003,
        "target_length": 4000.0,
        "delta": 0.5,
    }
    assert resolve_hparams("shorter_better", {"alpha": 2}) == {"alpha": 2.0, "beta": 0.001}
    assert resolve_hparams("laser_d", {"target_length": 4000}) == {
        "alpha": 0.5,
        "target_length": 4000.0,
    }
    assert resolve_hparams("alp", {"beta": 1e-7}) == {"beta": 1e-7, "K": None}
    # the defaults reproduce the table rows that use them
    for method in ("hapo", "l1_max", "laser_d"):
        hparams = PAPER_ROWS[method][0]
        required = {k: v for k, v in hparams.items() if k in ("h", "target_length")}
        assert shape_rewards(method, LENGTHS, CORRECT, **required) == shape_rewards(
            method, LENGTHS, CORRECT, **hparams
        )


def test_tensor_and_array_inputs():
    expected = shape_rewards("alp", LENGTHS, CORRECT, beta=1e-4)
    assert shape_rewards("alp", np.array(LENGTHS), np.array(CORRECT), beta=1e-4) == expected
    assert (
        shape_rewards("alp", torch.tensor(LENGTHS), torch.tensor(CORRECT).bool(), beta=1e-4)
        == expected
    )


@pytest.mark.parametrize(
    ("method", "hparams", "match"),
    [
        ("grpo_lp", {"alpha": 0.1}, "unknown shaping method"),
        ("rloo_lp", {}, "rloo_lp needs alpha"),
        ("rloo_lp", {"aplha": 0.1}, "not \\['aplha'\\]"),
        ("rloo_lp", {"alpha": 1.5}, "alpha must be a number in \\[0, 1\\]"),
        ("rloo_lp", {"alpha": float("nan")}, "alpha must be"),
        ("rloo_lp", {"alpha": True}, "alpha must be"),
        ("rloo_lp", {"alpha": "0.1"}, "alpha must be"),
        ("alp", {"beta": -1e-7}, "beta must be"),
        ("alp", {"beta": 1e-7, "K": 0}, "K must be an integer >= 1"),
        ("alp", {"beta": 1e-7, "K": 2.5}, "K must be an integer >= 1"),
        ("hapo", {}, "hapo needs h"),
        ("hapo", {"h": 0}, "h must be"),
        ("hapo", {"h": 10, "c": 0.5}, "c must be a number in \\[-1, 0\\]"),
        ("hapo", {"h": 10, "w": 2}, "w must be"),
        ("l1_max", {}, "l1_max needs target_length"),
        ("l1_max", {"target_length": 100, "delta": float("inf")}, "delta must be"),
        ("shorter_better", {}, "shorter_better needs alpha"),
        ("laser_d", {"alpha": 0.5}, "laser_d needs target_length"),
        ("laser_d", {"target_length": -1}, "target_length must be"),
    ],
)
def test_invalid_hyper_parameters(method, hparams, match):
    with pytest.raises(ValueError, match=match):
        shape_rewards(method, [10, 20], [1, 0], **hparams)


@pytest.mark.parametrize(
    ("lengths", "correct", "match"),
    [
        ([], [], "at least one response"),
        ([10, 20], [1], "2 lengths but 1 correctness"),
        ([-1, 20], [1, 0], "finite and >= 0"),
        ([float("nan")], [1], "finite and >= 0"),
        ([10, 20], [1, 2], "correctness must be 0/1"),
    ],
)
def test_invalid_groups(lengths, correct, match):
    with pytest.raises(ValueError, match=match):
        shape_rewards("laser_d", lengths, correct, target_length=15)


# --- properties -----------------------------------------------------------------------

groups = st.integers(1, 10).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(1, 16384), min_size=n, max_size=n),
        st.lists(st.integers(0, 1), min_size=n, max_size=n),
    )
)
VALID = {
    "rloo_lp": {"alpha": 0.3},
    "alp": {"beta": 1e-4},
    "hapo": {"w": 1.0, "c": -0.7, "h": 1500},
    "l1_max": {"target_length": 4000},
    "shorter_better": {"alpha": 2.0},
    "laser_d": {"target_length": 4000},
}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(groups)
def test_longer_correct_response_never_gets_more_reward(group):
    lengths, correct = group
    for method, hparams in VALID.items():
        r = shape_rewards(method, lengths, correct, **hparams)
        pos = sorted((n, ri) for n, ri, ok in zip(lengths, r, correct, strict=True) if ok)
        for (n1, r1), (n2, r2) in itertools.pairwise(pos):
            assert r1 >= r2 - 1e-12, (method, n1, r1, n2, r2)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(groups)
def test_correct_beats_incorrect_where_the_design_promises_it(group):
    # RLOO-LP (alpha <= 1), HAPO (w <= 1, c >= -1), L1-Max and LASER-D never rank a wrong
    # answer above a right one; ALP and ShorterBetter can (a long right answer is penalised
    # past a short wrong one), which is why they are not listed.
    lengths, correct = group
    for method in ("rloo_lp", "hapo", "l1_max", "laser_d"):
        r = shape_rewards(method, lengths, correct, **VALID[method])
        right = [ri for ri, ok in zip(r, correct, strict=True) if ok]
        wrong = [ri for ri, ok in zip(r, correct, strict=True) if not ok]
        if right and wrong:
            assert min(right) >= max(wrong), method


# --- LASER-D difficulty-adaptive target -------------------------------------------------


@pytest.mark.parametrize(
    ("n", "k", "level"),
    [
        (8, 8, "high"),
        (8, 6, "high"),
        (8, 5, "medium"),
        (8, 3, "medium"),
        (8, 2, "low"),
        (8, 0, "low"),
        (3, 2, "high"),
        (3, 1, "medium"),
        (6, 4, "high"),
        (6, 2, "medium"),
    ],
)
def test_laser_d_difficulty_buckets(n, k, level):
    assert laser_d_difficulty([1] * k + [0] * (n - k)) == level


def test_laser_d_target_length_follows_the_group_accuracy():
    targets = {"low": 8192, "medium": 6144, "high": 4096}
    assert laser_d_target_length([1, 1, 1, 0], targets) == 4096
    assert laser_d_target_length([1, 0, 0, 0], targets) == 8192
    assert laser_d_target_length([1, 1, 0, 0], targets) == 6144
    with pytest.raises(ValueError, match="exactly"):
        laser_d_target_length([1], {"low": 1, "high": 2})
    with pytest.raises(ValueError, match="> 0"):
        laser_d_target_length([1], {"low": 1, "medium": 0, "high": 2})


def test_laser_d_bucket_targets_by_hand():
    lengths = [100, 200, 300, 400, 500, 600]
    monitor = [
        (lengths, [1, 1, 1, 1, 1, 0]),  # high: needs floor(P * 4) >= 1, P >= 1/4 -> 2 of 6
        (lengths, [1, 1, 0, 0, 0, 0]),  # medium: floor(P * 2) >= 1, P >= 1/2 -> 3 of 6
        (lengths, [0] * 6),  # low: floor(P * 1) >= 1, all 6 responses within the target
    ]
    thresholds = [700, 150, 250, 350]  # unsorted on purpose
    assert laser_d_bucket_targets(monitor, thresholds, max_length=1000) == {
        "high": 250.0,
        "medium": 350.0,
        "low": 700.0,
    }
    # a level with no prompt, or no threshold that qualifies below max_length: max_length
    got = laser_d_bucket_targets(monitor[:2], [150, 250, 350, 700], max_length=500)
    assert got == {"high": 250.0, "medium": 350.0, "low": 500.0}
    # a stricter expectation moves the targets up
    assert laser_d_bucket_targets(monitor[:1], [150, 250, 350, 700], 1000, 2)["high"] == 350.0


def test_laser_d_bucket_targets_rejects_mixed_group_sizes():
    with pytest.raises(ValueError, match="same size"):
        laser_d_bucket_targets([([1, 2], [1, 0]), ([1], [1])], [10], max_length=20)
