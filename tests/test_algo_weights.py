import math

import pytest
import torch

from drpo_openrlhf.algo import (
    length_reward,
    pass_rate_lambda,
    positive_log_weights,
    positive_weights,
)

pytestmark = pytest.mark.usefixtures("float64_default")


def kl_regularised_reward(p: torch.Tensor, base: torch.Tensor, r: torch.Tensor, lam: float):
    """``E_P r - lambda KL(P || base)`` over a discrete outcome set."""
    support = p > 0
    kl = (p[support] * (p[support].log() - base[support].log())).sum()
    return (p * r).sum() - lam * kl


@pytest.mark.parametrize("lam", [0.05, 0.2, 1.0, 5.0])
@pytest.mark.parametrize("seed", range(4))
def test_closed_form_p_star_maximises_regularised_length_reward(lam, seed):
    gen = torch.Generator().manual_seed(seed)
    k = 7
    base = torch.rand(k, generator=gen) + 0.05
    base = base / base.sum()  # pi_old^+ over k correct outputs
    r = length_reward(torch.randint(1, 1000, (k,), generator=gen).double(), 1000)
    p_star = base * torch.exp(r / lam)
    p_star = p_star / p_star.sum()  # paper Eq. (6)
    best = kl_regularised_reward(p_star, base, r, lam)
    for _ in range(200):
        noise = torch.randn(k, generator=gen) * 0.3
        perturbed = p_star * noise.exp()
        perturbed = perturbed / perturbed.sum()
        assert kl_regularised_reward(perturbed, base, r, lam) <= best + 1e-12


def test_empirical_weights_are_p_star_of_the_sampled_correct_responses():
    # with pi+ the empirical distribution of the sampled correct responses, P* is w_hat
    r = torch.tensor([0.9, 0.2, 0.5, 0.7])
    correct = torch.tensor([True, True, False, True])
    w = positive_weights(r, correct, torch.zeros(4, dtype=torch.long), 0.3)
    pos = r[correct]
    expected = torch.exp(pos / 0.3) / torch.exp(pos / 0.3).sum()
    assert torch.allclose(w[correct], expected, atol=1e-15)
    assert w[2] == 0


def test_weights_normalise_within_each_prompt_only():
    r = torch.tensor([0.9, 0.2, 0.5, 0.7, 0.1, 0.3])
    correct = torch.tensor([True, True, False, True, False, True])
    group_ids = torch.tensor([5, 5, 5, 9, 9, 9])
    w = positive_weights(r, correct, group_ids, 0.1)
    assert w[:3].sum().item() == pytest.approx(1.0)
    assert w[3:].sum().item() == pytest.approx(1.0)
    assert w[0] > w[1] and w[3] > w[5]


def test_lambda_inf_gives_equal_weights():
    r = torch.tensor([0.9, 0.2, 0.5, 0.7])
    correct = torch.tensor([True, True, True, False])
    w = positive_weights(r, correct, torch.zeros(4, dtype=torch.long), math.inf)
    assert torch.allclose(w, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))


def test_tiny_lambda_is_a_stable_argmax_in_float32():
    r = torch.tensor([0.999, 0.0, 0.998], dtype=torch.float32)
    correct = torch.tensor([True, True, True])
    log_w = positive_log_weights(r, correct, torch.zeros(3, dtype=torch.long), 1e-3)
    w = log_w.exp()
    assert torch.isfinite(log_w).all()
    assert w.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert w[0].item() == pytest.approx(1 / (1 + math.exp(-1.0)), abs=1e-5)


def test_groups_without_correct_responses_get_no_weight():
    r = torch.tensor([0.9, 0.2])
    w = positive_weights(r, torch.tensor([False, False]), torch.tensor([0, 0]), 0.1)
    assert torch.equal(w, torch.zeros(2))


@pytest.mark.parametrize("lam", [0.0, -1.0, math.nan])
def test_lambda_must_be_positive(lam):
    with pytest.raises(ValueError, match="lambda must be positive"):
        positive_weights(torch.zeros(2), torch.tensor([True, True]), torch.zeros(2), lam)


def _groups_of_eight(hits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    correct = torch.tensor([i < c for c in hits for i in range(8)])
    return correct, torch.arange(len(hits)).repeat_interleave(8)


def test_pass_rate_lambda_divides_by_the_groups_own_rate_without_a_prior():
    correct, group_ids = _groups_of_eight([1, 2, 8, 0])
    lam = pass_rate_lambda(0.1, correct, group_ids).view(4, 8)
    assert (lam == lam[:, :1]).all()  # one lambda per prompt
    expected = torch.tensor([0.8, 0.4, 0.1, 0.1], dtype=torch.float64)  # no correct: lambda
    torch.testing.assert_close(lam[:, 0], expected, rtol=1e-15, atol=0)


def test_pass_rate_prior_shrinks_the_rate_towards_one_half():
    """``(c + a/2) / (n + a)``: with a = 4 pseudo-samples lambda_q lies in [1.2, 4] lambda at
    n = 8, and one more correct sample of the hardest prompt moves it by 1.33x, not 2x."""
    correct, group_ids = _groups_of_eight([1, 2, 8, 0])
    lam = pass_rate_lambda(0.1, correct, group_ids, prior=4.0).view(4, 8)[:, 0]
    rates = torch.tensor([3 / 12, 4 / 12, 10 / 12], dtype=torch.float64)
    torch.testing.assert_close(lam[:3], 0.1 / rates, rtol=1e-15, atol=0)
    assert lam[3] == 0.1
    huge = pass_rate_lambda(0.1, correct, group_ids, prior=1e12).view(4, 8)[:3, 0]
    torch.testing.assert_close(huge, torch.full((3,), 0.2, dtype=torch.float64), rtol=1e-9, atol=0)


@pytest.mark.parametrize("prior", [-1.0, math.inf, math.nan])
def test_pass_rate_prior_must_be_a_finite_count(prior):
    correct, group_ids = _groups_of_eight([1])
    with pytest.raises(ValueError, match="prior"):
        pass_rate_lambda(0.1, correct, group_ids, prior=prior)
