import pytest
import torch

from drpo_openrlhf.algo import kl_estimate, kl_penalty

pytestmark = pytest.mark.usefixtures("float64_default")


def test_kl_estimate_is_the_token_mean_over_the_mask():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    new = torch.tensor([[-1.5, -2.0, -9.0], [-0.7, -0.1, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert kl_estimate(new, old, mask).item() == pytest.approx((0.5 + 0.0 + 0.2 - 0.4) / 4)


def policy_kl(theta: torch.Tensor) -> torch.Tensor:
    old = torch.tensor([[-1.0, -2.0], [-0.3, -0.6]])
    new = old + torch.tensor([[1.0, -2.0], [0.5, 0.25]]) * theta
    return kl_estimate(new, old, torch.ones(2, 2))


@pytest.mark.parametrize("theta0", [0.001, 0.02, 0.3])
def test_hinge_gradient_is_zero_inside_and_2beta_outside(theta0):
    delta, beta0 = 0.05, 1e3
    theta = torch.tensor(theta0, requires_grad=True)
    kl = policy_kl(theta)
    (grad_penalty,) = torch.autograd.grad(kl_penalty(kl, delta, beta0), theta)
    theta2 = torch.tensor(theta0, requires_grad=True)
    (grad_kl,) = torch.autograd.grad(policy_kl(theta2), theta2)
    expected = 2 * beta0 * max(kl.item() - delta, 0.0) * grad_kl
    if kl.item() <= delta:
        assert grad_penalty.item() == 0.0
    else:
        assert grad_penalty.item() != 0.0
    assert grad_penalty.item() == pytest.approx(expected.item(), rel=1e-12, abs=0)


def test_penalty_value():
    assert kl_penalty(torch.tensor(3e-4), 1e-4, 1e3).item() == pytest.approx(1e3 * 4e-8)
    assert kl_penalty(torch.tensor(5e-5), 1e-4, 1e3).item() == 0.0
