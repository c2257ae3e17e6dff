"""The split gradient (coefficients + per-micro-batch surrogate) equals the one-piece one."""

import math

import pytest
import torch

from drpo_openrlhf.algo import (
    DRPOConfig,
    ResponseScalars,
    group_score_coefficients,
    loss_coefficients,
    microstep_coefficients,
    minibatch_loss,
    response_scalars,
    surrogate_loss,
)

pytestmark = pytest.mark.usefixtures("float64_default")
VOCAB, DIM, MAX_T = 11, 5, 9


class ToyPolicy(torch.nn.Module):
    """Token log-probs from a linear layer over fixed per-position features."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(DIM, VOCAB, generator=gen))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(features @ self.weight, dim=-1)
        return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def make_rollout(seed: int, num_prompts: int = 5, n: int = 4):
    gen = torch.Generator().manual_seed(seed)
    b = num_prompts * n
    lengths = torch.randint(1, MAX_T + 1, (b,), generator=gen)
    mask = (torch.arange(MAX_T) < lengths[:, None]).double()
    features = torch.randn(b, MAX_T, DIM, generator=gen)
    tokens = torch.randint(0, VOCAB, (b, MAX_T), generator=gen)
    correct = torch.rand(b, generator=gen) < 0.5
    group_ids = torch.arange(num_prompts).repeat_interleave(n)
    return features, tokens, mask, correct, group_ids


def split_gradient(policy, old_log_probs, rollout, micro_batches, config):
    features, tokens, mask, correct, group_ids = rollout

    def scalars(idx, step):
        lp = policy(features[idx], tokens[idx])
        return response_scalars(
            lp, old_log_probs[idx], mask[idx], correct[idx], group_ids[idx], step
        )

    with torch.no_grad():  # pass 1: scalars only (what ranks would all-gather)
        gathered = ResponseScalars.concat([scalars(idx, k) for k, idx in enumerate(micro_batches)])
    score_coef, kl_coef, metrics = loss_coefficients(gathered, config)
    policy.zero_grad()
    start = 0
    for k, idx in enumerate(micro_batches):  # pass 2: one backward per micro-batch
        r = scalars(idx, k)
        end = start + len(idx)
        surrogate_loss(r.score, r.kl_sum, score_coef[start:end], kl_coef[start:end]).backward()
        start = end
    return policy.weight.grad.clone(), metrics


def one_piece_gradient(policy, old_log_probs, rollout, micro_batches, config):
    features, tokens, mask, correct, group_ids = rollout
    parts = [
        response_scalars(
            policy(features[idx], tokens[idx]),
            old_log_probs[idx],
            mask[idx],
            correct[idx],
            group_ids[idx],
            k,
        )
        for k, idx in enumerate(micro_batches)
    ]
    loss, _ = minibatch_loss(ResponseScalars.concat(parts), config)
    policy.zero_grad()
    loss.backward()
    return policy.weight.grad.clone(), loss.detach()


def random_micro_batches(seed: int, b: int, size: int):
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(seed))
    return list(torch.split(perm, size))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("micro_size", [1, 3, 4, 7, 20])
@pytest.mark.parametrize("kl_estimate", ["minibatch", "microstep"])
@pytest.mark.parametrize("lam", [0.1, math.inf])
def test_split_gradient_is_exact(seed, micro_size, kl_estimate, lam):
    rollout = make_rollout(seed)
    old_policy = ToyPolicy(seed)
    policy = ToyPolicy(seed)
    with torch.no_grad():  # move away from pi_old so that the KL hinge is active
        policy.weight.add_(
            0.3 * torch.randn(DIM, VOCAB, generator=torch.Generator().manual_seed(99))
        )
        old_log_probs = old_policy(rollout[0], rollout[1])
    config = DRPOConfig(lam=lam, kl_estimate=kl_estimate, max_len=MAX_T)
    micro_batches = random_micro_batches(seed, rollout[0].shape[0], micro_size)
    split, metrics = split_gradient(policy, old_log_probs, rollout, micro_batches, config)
    whole, loss = one_piece_gradient(policy, old_log_probs, rollout, micro_batches, config)
    assert metrics["hinge_active"] > 0
    assert metrics["loss"].item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(split, whole, rtol=1e-10, atol=1e-12)


def group_micro_batches(seed: int, num_prompts: int, n: int) -> list[torch.Tensor]:
    """Micro-batches of whole groups: a random partition of shuffled prompts, rows shuffled."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randperm(num_prompts, generator=gen)
    cuts = sorted(torch.randperm(num_prompts - 1, generator=gen)[:2].add(1).tolist())
    parts = torch.tensor_split(prompts, cuts)
    rows = [(p[:, None] * n + torch.arange(n)).flatten() for p in parts]
    return [r[torch.randperm(len(r), generator=gen)] for r in rows]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"lam": math.inf},
        {"penalty_form": "paper", "lam": 0.05},
        {"keep_all_wrong": True, "all_correct_length_signal": True},
        {"lambda_by_pass_rate": True, "length_reward": "cosine"},
        {"lambda_by_pass_rate": True, "pass_rate_prior": 4.0},
    ],
    ids=str,
)
def test_one_pass_microstep_gradient_is_exact(seed, options):
    """With whole groups per micro-step, each micro-step's own scalars give its coefficients:
    one forward and backward per micro-batch reproduce the one-piece gradient."""
    num_prompts, n = 7, 4
    rollout = make_rollout(seed, num_prompts, n)
    features, tokens, mask, correct, group_ids = rollout
    policy = ToyPolicy(seed)
    with torch.no_grad():
        old_log_probs = ToyPolicy(seed + 50)(features, tokens)
    config = DRPOConfig(kl_estimate="microstep", max_len=MAX_T, **options)
    micro_batches = group_micro_batches(seed, num_prompts, n)

    policy.zero_grad()
    for k, idx in enumerate(micro_batches):
        r = response_scalars(
            policy(features[idx], tokens[idx]),
            old_log_probs[idx],
            mask[idx],
            correct[idx],
            group_ids[idx],
            k,
        )
        score_coef, kl_coef = microstep_coefficients(
            r, config, num_groups=num_prompts, num_microsteps=len(micro_batches)
        )
        surrogate_loss(r.score, r.kl_sum, score_coef, kl_coef).backward()
    one_pass = policy.weight.grad.clone()
    whole, _ = one_piece_gradient(policy, old_log_probs, rollout, micro_batches, config)
    assert whole.abs().max() > 1e-3
    assert torch.allclose(one_pass, whole, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("far", [True, False], ids=["hinge-active", "hinge-inactive"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"lam": math.inf},
        {"keep_all_wrong": True, "lambda_by_pass_rate": True},
        {"lambda_by_pass_rate": True, "pass_rate_prior": 2.0},
    ],
)
def test_score_pass_then_penalty_pass_gives_the_minibatch_gradient(seed, far, options):
    """Mini-batch KL, whole groups per micro-step: micro-step-local score coefficients in one
    pass, the penalty in a second pass only when the mini-batch KL exceeds delta."""
    num_prompts, n = 7, 4
    rollout = make_rollout(seed, num_prompts, n)
    features, tokens, mask, correct, group_ids = rollout
    policy = ToyPolicy(seed)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        # pi_old above pi_theta on the tokens: KL about 0.05 (hinge active) or 0 (inactive)
        old_log_probs = policy(features, tokens) + far * 0.1 * torch.rand(MAX_T, generator=gen)
    config = DRPOConfig(kl_estimate="minibatch", max_len=MAX_T, **options)
    micro_batches = group_micro_batches(seed, num_prompts, n)

    def scalars(k, idx):
        lp = policy(features[idx], tokens[idx])
        return response_scalars(lp, old_log_probs[idx], mask[idx], correct[idx], group_ids[idx], k)

    policy.zero_grad()
    parts = []
    for k, idx in enumerate(micro_batches):
        r = scalars(k, idx)
        score_coef = group_score_coefficients(r, config, num_groups=num_prompts)
        surrogate_loss(r.score, r.kl_sum, score_coef, torch.zeros_like(score_coef)).backward()
        parts.append(r)
    _, kl_coef, metrics = loss_coefficients(ResponseScalars.concat(parts), config)
    assert bool((kl_coef != 0).any()) == far == bool(metrics["hinge_active"])
    if far:  # the penalty pass
        start = 0
        for k, idx in enumerate(micro_batches):
            r = scalars(k, idx)
            kl = kl_coef[start : start + len(idx)]
            surrogate_loss(r.score, r.kl_sum, torch.zeros_like(kl), kl).backward()
            start += len(idx)
    two_pass = policy.weight.grad.clone()
    whole, _ = one_piece_gradient(policy, old_log_probs, rollout, micro_batches, config)
    assert whole.abs().max() > 1e-3
    assert torch.allclose(two_pass, whole, rtol=1e-10, atol=1e-12)


def test_microstep_coefficients_refuse_what_they_cannot_split():
    rollout = make_rollout(0, 2, 2)
    features, tokens, mask, correct, group_ids = rollout
    policy = ToyPolicy(0)
    with torch.no_grad():
        lp = policy(features, tokens)
    r = response_scalars(lp, lp, mask, correct, group_ids)
    with pytest.raises(ValueError, match="kl_estimate='microstep'"):
        microstep_coefficients(r, DRPOConfig(), 2, 1)
    two_steps = ResponseScalars.concat(
        [
            response_scalars(
                lp[i : i + 2],
                lp[i : i + 2],
                mask[i : i + 2],
                correct[i : i + 2],
                group_ids[i : i + 2],
                i // 2,
            )
            for i in (0, 2)
        ]
    )
    with pytest.raises(ValueError, match="one micro-step"):
        microstep_coefficients(two_steps, DRPOConfig(kl_estimate="microstep"), 2, 2)


def test_minibatch_kl_estimate_does_not_depend_on_micro_batching():
    rollout = make_rollout(1)
    policy, old = ToyPolicy(1), ToyPolicy(2)
    with torch.no_grad():
        old_log_probs = old(rollout[0], rollout[1])
    config = DRPOConfig(max_len=MAX_T)
    grads = [
        split_gradient(policy, old_log_probs, rollout, random_micro_batches(s, 20, m), config)[0]
        for s, m in [(0, 1), (1, 5), (2, 20)]
    ]
    assert all(torch.allclose(g, grads[0], rtol=1e-10, atol=1e-12) for g in grads)


def test_penalty_forms_differ_by_a_factor_two():
    rollout = make_rollout(3)
    policy = ToyPolicy(3)
    with torch.no_grad():  # pi_old more likely on every token: KL estimate 0.05 > delta
        old_log_probs = policy(rollout[0], rollout[1]) + 0.05
    mbs = random_micro_batches(0, 20, 20)
    kl_only = dict(lam=math.inf, max_len=MAX_T)
    grads = {}
    for form in ("authors", "paper"):
        with_penalty = split_gradient(
            policy, old_log_probs, rollout, mbs, DRPOConfig(penalty_form=form, **kl_only)
        )[0]
        without = split_gradient(
            policy, old_log_probs, rollout, mbs, DRPOConfig(beta0=0.0, **kl_only)
        )[0]
        grads[form] = with_penalty - without
    assert grads["authors"].abs().max() > 0
    assert torch.allclose(grads["paper"], 2 * grads["authors"], rtol=1e-9, atol=1e-12)


def test_metrics_report_lengths_by_correctness():
    r = ResponseScalars(
        score=torch.tensor([-0.1, -0.2, -0.3]),
        kl_sum=torch.zeros(3),
        num_tokens=torch.tensor([10.0, 20.0, 60.0]),
        correct=torch.tensor([True, True, False]),
        group_id=torch.zeros(3, dtype=torch.long),
        microstep=torch.zeros(3, dtype=torch.long),
    )
    _, metrics = minibatch_loss(r, DRPOConfig(max_len=100))
    assert metrics["response_length_correct"].item() == 15
    assert metrics["response_length_incorrect"].item() == 60
    assert metrics["response_length"].item() == pytest.approx(30)
    assert metrics["valid_prompt_fraction"].item() == 1


def test_response_scalars_reject_mismatched_fields():
    with pytest.raises(ValueError, match="1-D of one length"):
        ResponseScalars(*(torch.zeros(2),) * 5, torch.zeros(3))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lam=0.0),
        dict(tau=0.0),
        dict(tau=math.inf),
        dict(delta=-1.0),
        dict(beta0=-1.0),
        dict(penalty_form="half"),
        dict(kl_estimate="token"),
        dict(length_reward="exp"),
        dict(max_len=0),
        dict(lam=math.inf, lambda_by_pass_rate=True),
        dict(pass_rate_prior=4.0),  # without lambda_by_pass_rate it would do nothing
        dict(lambda_by_pass_rate=True, pass_rate_prior=-1.0),
        dict(lambda_by_pass_rate=True, pass_rate_prior=math.inf),
    ],
)
def test_config_rejects_invalid_values(kwargs):
    with pytest.raises(ValueError):
        DRPOConfig(**kwargs)


@pytest.mark.parametrize("field", ["score", "kl_sum"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_scalars_are_refused_before_any_gradient(field, value):
    rollout = make_rollout(0, 3, 2)
    features, tokens, mask, correct, group_ids = rollout
    with torch.no_grad():
        lp = ToyPolicy(0)(features, tokens)
    r = response_scalars(lp, lp, mask, correct, group_ids)
    broken = getattr(r, field).clone()
    broken[3] = value
    r = ResponseScalars(**{**r.__dict__, field: broken})
    with pytest.raises(ValueError, match=r"non-finite log-probs in 1 of 6 responses .*\[1\]"):
        loss_coefficients(r, DRPOConfig())
