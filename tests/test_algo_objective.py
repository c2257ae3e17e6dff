import math

import pytest
import torch
from drpo_reference import closed_form_g1, disco_loss
from hypothesis import given, settings
from hypothesis import strategies as st

from drpo_openrlhf.algo import drpo_loss, drpo_objective, length_reward, positive_weights

pytestmark = pytest.mark.usefixtures("float64_default")


def random_batch(seed: int, num_groups: int = 6, max_size: int = 9, max_len: int = 4096):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_size + 1, (num_groups,), generator=gen)
    group_ids = torch.repeat_interleave(torch.arange(num_groups) * 7 + 3, sizes)
    n = group_ids.numel()
    scores = -torch.rand(n, generator=gen) * 2
    correct = torch.rand(n, generator=gen) < 0.5
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen).double()
    perm = torch.randperm(n, generator=gen)
    return scores[perm], correct[perm], group_ids[perm], lengths[perm]


def loss_grad(scores, *args, **kwargs):
    s = scores.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(drpo_loss(s, *args, **kwargs), s)
    return g


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("lam", [0.05, 0.1, 1.0, math.inf])
def test_gradient_equals_algorithm_1_g1(seed, lam):
    scores, correct, group_ids, lengths = random_batch(seed)
    rewards = length_reward(lengths, 4096)
    grad = loss_grad(scores, correct, group_ids, rewards, lam, 10.0)
    expected = closed_form_g1(
        scores.tolist(), correct.tolist(), group_ids.tolist(), rewards.tolist(), lam, 10.0
    )
    assert torch.allclose(grad, torch.tensor(expected), atol=1e-9, rtol=0)


@pytest.mark.parametrize("seed", range(5))
def test_lambda_inf_is_disco(seed):
    scores, correct, group_ids, lengths = random_batch(seed)
    rewards = length_reward(lengths, 4096)
    ours = drpo_loss(scores, correct, group_ids, rewards, math.inf, 10.0)
    assert torch.allclose(ours, disco_loss(scores, correct, group_ids, 10.0), atol=1e-12)


def test_value_is_the_true_objective_by_hand():
    # one valid prompt (2 correct, 2 wrong) and one all-correct prompt that only counts in Q
    scores = torch.tensor([-0.5, -1.0, -0.2, -0.4, -0.3])
    correct = torch.tensor([True, True, False, False, True])
    group_ids = torch.tensor([0, 0, 0, 0, 1])
    rewards = torch.tensor([0.9, 0.6, 0.5, 0.1, 0.7])
    w0 = math.exp(0.9 / 0.1) / (math.exp(0.9 / 0.1) + math.exp(0.6 / 0.1))
    positive = w0 * -0.5 + (1 - w0) * -1.0
    negative = 10 * math.log((math.exp(-0.02) + math.exp(-0.04)) / 2)
    terms = drpo_objective(scores, correct, group_ids, rewards, 0.1, 10.0)
    assert terms.loss.item() == pytest.approx(-(positive - negative) / 2, abs=1e-12)
    assert terms.positive_term.item() == pytest.approx(positive / 2, abs=1e-12)
    assert terms.negative_term.item() == pytest.approx(negative / 2, abs=1e-12)
    assert terms.valid_fraction.item() == 0.5


def test_invalid_prompts_count_in_the_denominator_only():
    scores = torch.tensor([-0.5, -0.2, -0.3, -0.9])
    correct = torch.tensor([True, False, True, True])
    rewards = torch.tensor([0.5, 0.5, 0.2, 0.4])
    alone = drpo_loss(scores[:2], correct[:2], torch.tensor([0, 0]), rewards[:2])
    both = drpo_loss(scores, correct, torch.tensor([0, 0, 1, 1]), rewards)
    assert both.item() == pytest.approx(alone.item() / 2, abs=1e-12)
    grad = loss_grad(scores, correct, torch.tensor([0, 0, 1, 1]), rewards)
    assert grad[2:].abs().max() == 0


def test_keep_all_wrong_adds_the_negative_term():
    scores = torch.tensor([-0.5, -0.2, -0.3, -0.9])
    correct = torch.tensor([True, False, False, False])
    group_ids = torch.tensor([0, 0, 1, 1])
    rewards = torch.full((4,), 0.5)
    base = drpo_loss(scores, correct, group_ids, rewards)
    kept = drpo_loss(scores, correct, group_ids, rewards, keep_all_wrong=True)
    negative = 10 * (torch.logsumexp(scores[2:] / 10, 0) - math.log(2))
    assert (kept - base).item() == pytest.approx(negative.item() / 2, abs=1e-12)
    grad = loss_grad(scores, correct, group_ids, rewards, keep_all_wrong=True)
    assert (grad[2:] > 0).all()


def test_all_correct_length_signal_is_zero_mean_and_favours_short():
    scores = torch.tensor([-0.5, -0.2, -0.3])
    correct = torch.tensor([True, True, True])
    group_ids = torch.zeros(3, dtype=torch.long)
    rewards = length_reward(torch.tensor([100.0, 400.0, 900.0]), 1000)
    assert drpo_loss(scores, correct, group_ids, rewards).item() == 0
    grad = loss_grad(scores, correct, group_ids, rewards, all_correct_length_signal=True)
    assert grad.sum().item() == pytest.approx(0.0, abs=1e-12)
    assert grad[0] < 0 < grad[2]


def test_lambda_by_pass_rate_flattens_weights_on_hard_prompts():
    lengths = torch.tensor([100.0, 900.0, 50.0, 50.0, 100.0, 900.0, 50.0, 50.0])
    rewards = length_reward(lengths, 1000)
    correct = torch.tensor([True, True, True, True, True, True, False, False])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    w_fixed = positive_weights(rewards, correct, group_ids, 0.1)
    scores = torch.full((8,), -0.5)
    grad = loss_grad(scores, correct, group_ids, rewards, lambda_by_pass_rate=True)
    # prompt 1 (pass rate 1/2) uses lambda 0.2: flatter than with lambda 0.1
    flat = positive_weights(rewards, correct, group_ids, 0.2)
    assert torch.allclose(-grad[4:6] * 2, flat[4:6], atol=1e-12)
    assert flat[4] < w_fixed[4]


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="one shape"):
        drpo_loss(torch.zeros(3), torch.ones(2, dtype=torch.bool), torch.zeros(3), torch.zeros(3))


@st.composite
def batches(draw):
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    n = sum(sizes)
    group_ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    scores = draw(st.lists(st.floats(-20, 0), min_size=n, max_size=n))
    correct = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    max_len = draw(st.integers(1, 8192))
    lengths = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    lam = draw(st.one_of(st.floats(1e-3, 100), st.just(math.inf)))
    tau = draw(st.floats(0.1, 100))
    perm = draw(st.permutations(range(n)))
    return (
        torch.tensor(scores),
        torch.tensor(correct),
        torch.tensor(group_ids),
        length_reward(torch.tensor(lengths, dtype=torch.float64), max_len),
        lam,
        tau,
        torch.tensor(perm),
    )


@settings(max_examples=150, deadline=None)
@given(batches())
def test_properties_signs_invariance_finiteness(batch):
    scores, correct, group_ids, rewards, lam, tau, perm = batch
    for keep_all_wrong in (False, True):
        loss = drpo_loss(
            scores, correct, group_ids, rewards, lam, tau, keep_all_wrong=keep_all_wrong
        )
        grad = loss_grad(
            scores, correct, group_ids, rewards, lam, tau, keep_all_wrong=keep_all_wrong
        )
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        # descent never lowers a correct response's score nor raises an incorrect one's
        assert (grad[correct] <= 0).all() and (grad[~correct] >= 0).all()
    # permuting responses and relabelling prompts changes nothing
    relabelled = 100 - 3 * group_ids
    loss = drpo_loss(scores, correct, group_ids, rewards, lam, tau)
    grad = loss_grad(scores, correct, group_ids, rewards, lam, tau)
    args = (scores[perm], correct[perm], relabelled[perm], rewards[perm], lam, tau)
    assert torch.allclose(drpo_loss(*args), loss, atol=1e-10, rtol=1e-10)
    assert torch.allclose(loss_grad(*args), grad[perm], atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("lam", [1e-3, 1e-2, 0.1])
def test_small_lambda_is_stable_in_float32(lam):
    scores = torch.tensor([-0.5, -1.0, -0.2], dtype=torch.float32)
    correct = torch.tensor([True, True, False])
    rewards = torch.tensor([0.99, 0.01, 0.5], dtype=torch.float32)
    s = scores.clone().requires_grad_(True)
    loss = drpo_loss(s, correct, torch.zeros(3, dtype=torch.long), rewards, lam, 10.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(s.grad).all()
    expected = -1 / (1 + math.exp(-(0.99 - 0.01) / lam))
    assert s.grad[0].item() == pytest.approx(expected, abs=1e-6)
