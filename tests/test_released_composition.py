"""The cross-rank layout with ``kl_estimate="microstep"`` reproduces the released code's update.

The released code (``official-code-notes.md``) trains 8 ranks x 4 rows per micro-step with
rank ``r`` holding response ``r`` of every prompt, so each global micro-step holds 4 whole
groups; it applies the objective over the mini-batch's 32 prompts and, per micro-step, the
penalty gradient ``beta [KL_m - delta]_+ grad KL_m``, averaged over micro-steps. The reference
below is written from those notes alone (no ``drpo_openrlhf.algo`` code); the other side is
what the DRPO actor computes: ``deal_rollout`` deals the rollout to 8 simulated ranks, each
forwards its micro-batch, the micro-step's scalars are concatenated in rank order (the
all-gather), ``microstep_coefficients`` gives the coefficients and every rank back-propagates
its own ``surrogate_loss``.
"""

import pytest
import torch

from drpo_openrlhf.algo import (
    DRPOConfig,
    ResponseScalars,
    microstep_coefficients,
    response_scalars,
    surrogate_loss,
)
from drpo_openrlhf.update.layout import Layout, deal_rollout, plan_from_slots

pytestmark = pytest.mark.usefixtures("float64_default")
WORLD, ROWS, N, PROMPTS = 8, 4, 8, 32  # the paper's mini-batch: 256 responses
VOCAB, DIM, MAX_T = 13, 6, 12
LAM, TAU, DELTA, BETA = 0.1, 10.0, 1e-4, 1e3


def rollout(seed: int):
    """32 prompts x 8 responses in generation order, token log-probs with a graph."""
    gen = torch.Generator().manual_seed(seed)
    b = PROMPTS * N
    lengths = torch.randint(1, MAX_T + 1, (b,), generator=gen)
    mask = (torch.arange(MAX_T) < lengths[:, None]).double()
    features = torch.randn(b, MAX_T, DIM, generator=gen)
    tokens = torch.randint(0, VOCAB, (b, MAX_T), generator=gen)
    correct = torch.rand(b, generator=gen) < 0.5
    correct[: 4 * N] = True  # a few all-correct prompts: they count in the 32 but add nothing
    weight = torch.nn.Parameter(torch.randn(DIM, VOCAB, generator=gen))
    # pi_old: close to pi_theta on the prompts of every other micro-step (KL below delta)
    near = (torch.arange(b) // (N * ROWS)) % 2 == 0
    noise = torch.rand(b, MAX_T, generator=gen) * torch.where(near, 1e-6, 4e-3)[:, None]
    return features, tokens, mask, correct, weight, noise


def token_log_probs(weight, features, tokens):
    log_probs = torch.log_softmax(features @ weight, dim=-1)
    return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def released_gradient(weight, features, tokens, mask, correct, old):
    """The released arithmetic, from the notes: rank ``r`` = response ``r`` of every prompt,
    micro-step ``j`` = rows ``4j..4j+3`` of every rank = prompts ``4j..4j+3``."""
    new = token_log_probs(weight, features, tokens)
    score = (new * mask).sum(-1) / mask.sum(-1)
    objective = 0.0
    for q in range(PROMPTS):
        rows = slice(q * N, (q + 1) * N)
        pos, neg = correct[rows], ~correct[rows]
        if not (pos.any() and neg.any()):
            continue
        w = torch.softmax((1 - mask[rows].sum(-1)[pos] / MAX_T) / LAM, dim=0)
        objective = objective + (w * score[rows][pos]).sum()
        objective = objective - TAU * torch.logsumexp(score[rows][neg] / TAU, dim=0)
    loss = -objective / PROMPTS
    micro_steps = PROMPTS * N // (WORLD * ROWS)
    hinges = []
    for j in range(micro_steps):
        rows = slice(j * ROWS * N, (j + 1) * ROWS * N)  # prompts 4j..4j+3, all responses
        kl = ((old[rows] - new[rows]) * mask[rows]).sum() / mask[rows].sum()
        hinge = BETA * torch.clamp(kl.detach() - DELTA, min=0)  # gradient beta[KL-delta]_+ dKL
        loss = loss + hinge * kl / micro_steps
        hinges.append(float(hinge))
    (grad,) = torch.autograd.grad(loss, weight)
    return grad, hinges


def drpo_gradient(weight, features, tokens, mask, correct, old):
    """What the actor computes on 8 ranks dealt by ``deal_rollout`` (ranks simulated)."""
    layout = Layout(WORLD, N, PROMPTS, PROMPTS * N, ROWS)
    layout.check()
    assert layout.groups_fit_micro_steps
    group_ids = torch.arange(PROMPTS).repeat_interleave(N)
    dealt = deal_rollout(group_ids.tolist(), layout)
    plans = []
    for pairs in dealt:
        positions = torch.tensor([i for i, _ in pairs])
        (step,) = plan_from_slots([s for _, s in pairs], layout)  # one optimizer step
        plans.append([positions[mb] for mb in step])
    config = DRPOConfig(
        lam=LAM, tau=TAU, delta=DELTA, beta0=BETA, kl_estimate="microstep", max_len=MAX_T
    )
    grad = torch.zeros_like(weight)
    for j in range(layout.micro_steps):
        per_rank = []
        for plan in plans:
            idx = plan[j]
            per_rank.append(
                response_scalars(
                    token_log_probs(weight, features[idx], tokens[idx]),
                    old[idx],
                    mask[idx],
                    correct[idx],
                    group_ids[idx],
                    j,
                )
            )
        gathered = ResponseScalars.concat(per_rank)
        score_coef, kl_coef = microstep_coefficients(
            gathered, config, num_groups=PROMPTS, num_microsteps=layout.micro_steps
        )
        offset = 0
        for r in per_rank:  # each rank back-propagates its own rows
            end = offset + r.score.numel()
            loss = surrogate_loss(r.score, r.kl_sum, score_coef[offset:end], kl_coef[offset:end])
            grad += torch.autograd.grad(loss, weight)[0]
            offset = end
    return grad


def test_rank_r_holds_response_r_of_every_prompt():
    group_ids = [i // N for i in range(PROMPTS * N)]
    dealt = deal_rollout(group_ids, Layout(WORLD, N, PROMPTS, PROMPTS * N, ROWS))
    for rank, pairs in enumerate(dealt):
        assert [i for i, _ in pairs] == [q * N + rank for q in range(PROMPTS)]
        assert [s for _, s in pairs] == [q // ROWS for q in range(PROMPTS)]


@pytest.mark.parametrize("seed", range(3))
def test_cross_rank_microstep_update_is_the_released_update(seed):
    features, tokens, mask, correct, weight, noise = rollout(seed)
    with torch.no_grad():
        old = token_log_probs(weight, features, tokens) + noise
    expected, hinges = released_gradient(weight, features, tokens, mask, correct, old)
    got = drpo_gradient(weight, features, tokens, mask, correct, old)
    assert any(h == 0 for h in hinges) and any(h > 0 for h in hinges)  # both kinds of step
    assert expected.abs().max() > 1e-2
    assert torch.allclose(got, expected, rtol=1e-10, atol=1e-13)
