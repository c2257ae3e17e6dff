import math

import pytest
import torch

from drpo_openrlhf.algo import length_reward


@pytest.mark.parametrize(
    ("kind", "half"),
    [("linear", 0.5), ("concave", 0.75), ("cosine", 0.5)],
)
def test_length_reward_endpoints_and_midpoint(kind, half):
    r = length_reward(torch.tensor([0.0, 50.0, 100.0]), 100, kind)
    assert torch.allclose(r, torch.tensor([1.0, half, 0.0]), atol=1e-7)


def test_length_reward_formulas():
    lengths = torch.tensor([10.0, 37.0, 80.0], dtype=torch.float64)
    x = lengths / 100
    assert torch.allclose(length_reward(lengths, 100, "linear"), 1 - x)
    assert torch.allclose(length_reward(lengths, 100, "concave"), 1 - x**2)
    assert torch.allclose(length_reward(lengths, 100, "cosine"), 0.5 + 0.5 * torch.cos(math.pi * x))


def test_length_reward_is_decreasing_and_clipped_beyond_c():
    lengths = torch.arange(0, 300, dtype=torch.float64)
    for kind in ("linear", "concave", "cosine"):
        r = length_reward(lengths, 200, kind)
        assert (r[1:] <= r[:-1]).all()
        assert torch.all(r[200:] == r[200])


def test_length_reward_accepts_integer_lists():
    r = length_reward([1, 2, 4], 4)
    assert r.dtype == torch.get_default_dtype()
    assert r.tolist() == [0.75, 0.5, 0.0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([1.0], 100, "quadratic"), "unknown length reward"),
        (([1.0], 0, "linear"), "must be positive"),
        (([-1.0], 100, "linear"), "non-negative"),
    ],
)
def test_length_reward_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        length_reward(*args)
