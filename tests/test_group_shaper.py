import json
import math

import pytest
import torch

from drpo_openrlhf.algo.baseline_rewards import shape_rewards
from drpo_openrlhf.algo.group_shaper import GroupRewardShaper


def hapo_reward(length: float, ok: bool, h: float | None, w: float = 1.0, c: float = -0.7):
    """HAPO's reward written out for one response (paper Appendix table)."""
    if h is None:
        return float(ok)
    x = math.cos(min(math.pi / 2 * length / h, math.pi))
    return 1 + w * max(x, c) if ok else w * min(x, 0.0)


def test_non_hapo_methods_shape_each_group_independently():
    keys = ["p"] * 4 + ["q"] * 4 + ["r"] * 4
    lengths = [100, 250, 400, 90, 1000, 1200, 50, 60, 300, 300, 300, 300]
    correct = [1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1]
    shaper = GroupRewardShaper("rloo_lp", 4, alpha=0.2)
    expected = []
    for s in (0, 4, 8):
        expected += shape_rewards("rloo_lp", lengths[s : s + 4], correct[s : s + 4], alpha=0.2)
    assert shaper.shape(keys, lengths, correct) == expected
    assert shaper.state_dict()["history"] == {}  # nothing to remember


def test_hapo_history_across_two_steps():
    shaper = GroupRewardShaper("hapo", 3, w=0.5)
    keys = ["a"] * 3 + ["b"] * 3
    # step 1: no history, so correctness only; then a -> 300, b (none correct) stays unset
    step1 = shaper.shape(keys, [300, 500, 200, 100, 900, 400], [1, 1, 0, 0, 0, 0])
    assert step1 == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert shaper.state_dict()["history"] == {"a": 300.0}
    # step 2: a is rewarded against h = 300 (not its own new shortest 150), b still has none
    lengths, correct = [150, 450, 700, 800, 80, 90], [1, 1, 0, 1, 0, 1]
    step2 = shaper.shape(keys, lengths, correct)
    expected = [
        hapo_reward(n, ok, 300, w=0.5) for n, ok in zip(lengths[:3], correct[:3], strict=True)
    ]
    assert step2 == pytest.approx([*expected, 1.0, 0.0, 1.0])
    assert shaper.state_dict()["history"] == {"a": 150.0, "b": 90.0}
    # step 3: a longer correct answer never raises the recorded shortest length
    shaper.shape(["a"] * 3, [999, 999, 999], [1, 1, 1])
    assert shaper.state_dict()["history"]["a"] == 150.0


def test_hapo_same_prompt_twice_in_a_batch_uses_the_history_before_the_batch():
    shaper = GroupRewardShaper("hapo", 2)
    shaper.load_state_dict({"method": "hapo", "history": {"a": 400}, "bucket_targets": None})
    keys = ["a", "a", "a", "a"]
    out = shaper.shape(keys, [100, 800, 600, 200], [1, 0, 1, 1])
    expected = [hapo_reward(n, ok, 400) for n, ok in ((100, 1), (800, 0), (600, 1), (200, 1))]
    assert out == pytest.approx(expected)
    assert shaper.state_dict()["history"] == {"a": 100.0}
    # so the order of groups within a batch does not matter
    other = GroupRewardShaper("hapo", 2)
    other.load_state_dict({"method": "hapo", "history": {"a": 400}, "bucket_targets": None})
    swapped = other.shape(keys, [600, 200, 100, 800], [1, 1, 1, 0])
    assert swapped == out[2:] + out[:2]


def test_hapo_history_survives_a_json_round_trip():
    keys = ["prompt one"] * 2 + ["prompt two"] * 2
    steps = [
        ([500, 300, 200, 900], [1, 1, 1, 0]),
        ([250, 280, 700, 100], [1, 0, 1, 0]),
        ([240, 260, 150, 160], [1, 1, 1, 1]),
    ]
    uninterrupted = GroupRewardShaper("hapo", 2, w=1.0, c=-0.7)
    expected = [uninterrupted.shape(keys, *step) for step in steps]

    first = GroupRewardShaper("hapo", 2, w=1.0, c=-0.7)
    first.shape(keys, *steps[0])
    saved = json.dumps(first.state_dict())
    resumed = GroupRewardShaper("hapo", 2, w=1.0, c=-0.7)
    resumed.load_state_dict(json.loads(saved))
    assert [resumed.shape(keys, *step) for step in steps[1:]] == expected[1:]
    assert resumed.state_dict() == uninterrupted.state_dict()
    # and a fresh shaper that lost its history rewards differently
    assert GroupRewardShaper("hapo", 2).shape(keys, *steps[1]) != expected[1]


def test_tensor_inputs():
    shaper = GroupRewardShaper("hapo", 2)
    out = shaper.shape(["k", "k"], torch.tensor([10, 20]), torch.tensor([True, False]))
    assert out == [1.0, 0.0] and shaper.state_dict()["history"] == {"k": 10.0}


@pytest.mark.parametrize(
    ("keys", "lengths", "correct", "match"),
    [
        (["a", "a", "b", "a"], [1, 2, 3, 4], [1, 0, 1, 0], "responses 2..3 should be one"),
        (["a", "b", "b", "b"], [1, 2, 3, 4], [1, 0, 1, 0], "responses 0..1"),
        (["a", "a", "a"], [1, 2, 3], [1, 0, 1], "not made of groups of 2"),
        (["a", "a"], [1, 2, 3], [1, 0, 1], "2 prompt keys, 3 lengths"),
        ([1, 1], [1, 2], [1, 0], "must be str"),
    ],
)
def test_batch_layout_is_validated(keys, lengths, correct, match):
    with pytest.raises(ValueError, match=match):
        GroupRewardShaper("hapo", 2).shape(keys, lengths, correct)


def test_constructor_validates_eagerly():
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        GroupRewardShaper("alp", 0, beta=1e-7)
    with pytest.raises(ValueError, match="rloo_lp needs alpha"):
        GroupRewardShaper("rloo_lp", 8)
    with pytest.raises(ValueError, match="unknown shaping method"):
        GroupRewardShaper("dapo", 8)
    with pytest.raises(ValueError, match="set per group"):
        GroupRewardShaper("hapo", 8, h=100)


def test_load_state_dict_validates():
    shaper = GroupRewardShaper("hapo", 2)
    with pytest.raises(ValueError, match="method 'alp'"):
        shaper.load_state_dict({"method": "alp", "history": {}})
    with pytest.raises(ValueError, match="history must map"):
        shaper.load_state_dict({"method": "hapo", "history": {"a": -3}})
    with pytest.raises(ValueError, match="history must map"):
        shaper.load_state_dict({"method": "hapo", "history": [["a", 3]]})


def test_laser_d_with_bucket_targets_chooses_the_target_per_group():
    targets = {"low": 1000, "medium": 600, "high": 300}
    shaper = GroupRewardShaper("laser_d", 3, alpha=0.5, bucket_targets=targets)
    keys = ["easy"] * 3 + ["mid"] * 3 + ["hard"] * 3
    lengths = [250, 350, 200, 500, 700, 100, 900, 100, 100]
    correct = [1, 1, 1, 1, 0, 0, 1, 0, 0]
    # easy (3/3) -> 300, mid (1/3) -> 600, hard (1/3) -> 600 as well
    assert shaper.shape(keys, lengths, correct) == [1.5, 1.0, 1.5, 1.5, 0.0, 0.0, 1.0, 0, 0]
    shaper.set_bucket_targets({"low": 1000, "medium": 1000, "high": 1000})
    assert shaper.shape(keys[:3], lengths[:3], correct[:3]) == [1.5, 1.5, 1.5]
    restored = GroupRewardShaper("laser_d", 3, alpha=0.5, target_length=10)
    restored.load_state_dict(json.loads(json.dumps(shaper.state_dict())))
    assert restored.shape(keys, lengths, correct) == shaper.shape(keys, lengths, correct)


def test_laser_d_fixed_target_and_bucket_errors():
    fixed = GroupRewardShaper("laser_d", 2, target_length=300)
    assert fixed.shape(["a", "a"], [300, 301], [1, 1]) == [1.5, 1.0]
    with pytest.raises(ValueError, match="set per group"):
        GroupRewardShaper(
            "laser_d", 2, target_length=3, bucket_targets={"low": 1, "medium": 1, "high": 1}
        )
    with pytest.raises(ValueError, match="exactly"):
        GroupRewardShaper("laser_d", 2, bucket_targets={"low": 1})
    with pytest.raises(ValueError, match="laser_d setting"):
        GroupRewardShaper("alp", 2, beta=1e-7).set_bucket_targets(
            {"low": 1, "medium": 1, "high": 1}
        )
