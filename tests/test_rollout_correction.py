"""The rollout correction (``algo/rollout_correction.py``): the identity at mu = pi_old bit for
bit, the gradient of the corrected objective against an fp64 reference written from the
derived formula, each variant's weights, the effective sample size, the engines' KL, and
every refused combination of OpenRLHF's flags, in the pure function and before launch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from drpo_openrlhf import train
from drpo_openrlhf.algo import (
    DRPOConfig,
    ResponseScalars,
    drpo_objective,
    loss_coefficients,
    minibatch_loss,
    response_scalars,
    surrogate_loss,
)
from drpo_openrlhf.algo.rollout_correction import (
    RolloutCorrection,
    correction_metrics,
    refusal,
    rollout_correction,
    rollout_weights,
)

VOCAB, DIM, MAX_T, N = 11, 5, 9, 4
RATIO_BAND, DIVERGENCE_BAND = (0.5, 5.0), (0.0, 0.05)
# every combination DRPO runs (level, mode, gating)
VARIANTS = [
    ("token", "clip", "ratio"),
    ("token", "mask", "ratio"),
    ("token", "mask", "binary_kl"),
    ("token", "mask", "tv"),
    ("seq", "mask", "ratio"),
    ("seq", "mask", "binary_kl"),
    ("seq", "mask", "tv"),
    ("seq", "clip", "ratio"),
]


def variant(level: str, mode: str, gating: str) -> RolloutCorrection:
    band = RATIO_BAND if gating == "ratio" else DIVERGENCE_BAND
    return RolloutCorrection(level, mode, gating, *band)


class ToyPolicy(torch.nn.Module):
    """Token log-probs from a linear layer over fixed per-position features."""

    def __init__(self, seed: int, dtype: torch.dtype):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(DIM, VOCAB, generator=gen, dtype=dtype))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(features.to(self.weight.dtype) @ self.weight, dim=-1)
        return log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def make_batch(seed: int = 0, prompts: int = 5, dtype: torch.dtype = torch.float64) -> dict:
    """Responses of ``prompts`` groups of ``N``; pi_old a shifted copy of the policy (so the
    KL estimate is positive and the hinge acts) and the engines' log-probs off pi_old's by a
    per-response offset and per-token noise (some ratios and sequences out of band)."""
    gen = torch.Generator().manual_seed(seed)
    b = prompts * N
    lengths = torch.randint(1, MAX_T + 1, (b,), generator=gen)
    mask = (torch.arange(MAX_T) < lengths[:, None]).to(dtype)
    features = torch.randn(b, MAX_T, DIM, generator=gen)
    tokens = torch.randint(0, VOCAB, (b, MAX_T), generator=gen)
    correct = torch.rand(b, generator=gen) < 0.5
    correct[0::N], correct[1::N] = True, False
    correct[2 * N : 3 * N] = True  # one all-correct group
    correct[3 * N : 4 * N] = False  # one all-wrong group
    policy = ToyPolicy(1, dtype)
    with torch.no_grad():
        old = (policy(features, tokens) + 0.3) * mask
    offset = 0.4 * torch.randn(b, 1, generator=gen, dtype=torch.float64)
    noise = 0.5 * torch.randn(b, MAX_T, generator=gen, dtype=torch.float64)
    engine = ((old.double() - offset - noise) * mask.double()).to(dtype)
    return dict(
        features=features,
        tokens=tokens,
        mask=mask,
        correct=correct,
        group_ids=torch.arange(prompts).repeat_interleave(N),
        old=old,
        engine=engine,
        policy=policy,
    )


def scalars(data: dict, idx, correction: RolloutCorrection | None, engine=None, step: int = 0):
    lp = data["policy"](data["features"][idx], data["tokens"][idx]) * data["mask"][idx]
    engine = data["engine"] if engine is None else engine
    weights = None
    if correction is not None:
        weights = rollout_weights(correction, data["old"][idx], engine[idx], data["mask"][idx])
    return response_scalars(
        lp,
        data["old"][idx],
        data["mask"][idx],
        data["correct"][idx],
        data["group_ids"][idx],
        step,
        weights=weights,
    )


def config_of(correction: RolloutCorrection | None, **options) -> DRPOConfig:
    extra = {} if correction is None else {"rollout_correction": correction}
    return DRPOConfig(lam=0.3, delta=0.0, max_len=MAX_T, **extra, **options)


def loss_and_gradient(data: dict, correction, engine=None, **options):
    everyone = torch.arange(data["mask"].shape[0])
    r = scalars(data, everyone, correction, engine)
    loss, metrics = minibatch_loss(r, config_of(correction, **options))
    data["policy"].zero_grad()
    loss.backward()
    return loss.detach(), data["policy"].weight.grad.clone(), metrics


OPTIONS = [
    {},
    {"kl_estimate": "microstep"},
    {"keep_all_wrong": True, "all_correct_length_signal": True},
    {"lambda_by_pass_rate": True, "pass_rate_prior": 2.0},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("names", VARIANTS, ids="-".join)
def test_at_mu_equal_pi_old_every_variant_is_the_uncorrected_objective_bit_for_bit(
    names, options, dtype
):
    """Equal tensors, not close ones: the loss, the policy's gradient, the coefficients."""
    data = make_batch(dtype=dtype)
    plain_loss, plain_grad, _ = loss_and_gradient(data, None, **options)
    loss, grad, metrics = loss_and_gradient(data, variant(*names), data["old"].clone(), **options)
    assert torch.equal(loss, plain_loss)
    assert torch.equal(grad, plain_grad)
    everyone = torch.arange(data["mask"].shape[0])
    plain = loss_coefficients(scalars(data, everyone, None), config_of(None, **options))
    r = scalars(data, everyone, variant(*names), data["old"].clone())
    corrected = loss_coefficients(r, config_of(variant(*names), **options))
    assert torch.equal(corrected[0], plain[0]) and torch.equal(corrected[1], plain[1])
    assert metrics["is_kl"] == 0 and metrics["is_filtered"] == 0 and metrics["is_ess_min"] == 1


def test_the_identity_is_no_accident_of_equal_weights():
    """The same engines shifted by a little: the loss moves (seq clip) and the gradient moves
    (token clip), so the identity above can fail."""
    data = make_batch()
    _, plain_grad, _ = loss_and_gradient(data, None)
    shifted = data["old"] - 0.01 * data["mask"]
    _, grad, _ = loss_and_gradient(data, variant("token", "clip", "ratio"), shifted)
    assert not torch.equal(grad, plain_grad)
    plain_loss, _, _ = loss_and_gradient(data, None)
    noisy = make_batch()["engine"]
    loss, _, _ = loss_and_gradient(data, variant("seq", "clip", "ratio"), noisy)
    assert abs(loss - plain_loss) > 1e-3


def reference_weights(correction: RolloutCorrection, old, engine, mask):
    """Token weights, sequence log weights and keep flags, response by response in floats."""
    token_w, log_v, keep = torch.zeros_like(old, dtype=torch.float64), [], []
    low, high = correction.low, correction.high
    for i in range(old.shape[0]):
        steps = [t for t in range(old.shape[1]) if mask[i, t]]
        log_r = [float(old[i, t]) - float(engine[i, t]) for t in steps]
        r = [math.exp(x) for x in log_r]

        def divergence(t: int, i: int = i) -> float:
            p = min(max(math.exp(float(engine[i, t])), 1e-6), 1 - 1e-6)
            q = min(max(math.exp(float(old[i, t])), 1e-6), 1 - 1e-6)
            if correction.gating == "tv":
                return abs(p - q)
            return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))

        kept, log_weight = True, 0.0
        if correction.level == "token":
            for k, t in enumerate(steps):
                if correction.mode == "clip":
                    token_w[i, t] = min(max(r[k], low), high)
                else:
                    stat = r[k] if correction.gating == "ratio" else divergence(t)
                    token_w[i, t] = r[k] if low <= stat <= high else 0.0
        elif correction.mode == "clip":
            log_weight = min(max(sum(log_r), math.log(low)), math.log(high))
            for t in steps:
                token_w[i, t] = 1.0
        else:
            if correction.gating == "ratio":
                stat = math.exp(sum(log_r) / len(steps))
            else:
                stat = sum(divergence(t) for t in steps) / len(steps)
            kept = low <= stat <= high
            for k, t in enumerate(steps):
                token_w[i, t] = r[k] if kept else 0.0
        log_v.append(log_weight)
        keep.append(kept)
    return token_w, torch.tensor(log_v, dtype=torch.float64), torch.tensor(keep)


def reference_loss(data, correction, microsteps, kl_estimate, all_options: bool):
    """The corrected objective written out (fp64, autograd): per group, the positives'
    softmax of ``r/lambda + log v`` over the kept correct responses, the negatives'
    ``tau [lse(s/tau + log v) - lse(log v)]``, scores whose gradient carries the token
    weights; the KL weighted by ``v`` and the token weights, its squared hinge."""
    lam, tau, beta0 = 0.3, 10.0, 1e3 / 2  # the authors' penalty form: half the paper's
    mask, correct, groups = data["mask"], data["correct"], data["group_ids"]
    lp = data["policy"](data["features"], data["tokens"]) * mask
    token_w, log_v, keep = reference_weights(correction, data["old"], data["engine"], mask)
    n = mask.sum(-1)
    s = (lp * mask).sum(-1) / n
    weighted = (lp * token_w).sum(-1) / n
    score = weighted + (s - weighted).detach()  # the value of s, the weighted gradient
    reward = 1 - (n / MAX_T).clamp(max=1)
    total = lp.new_zeros(())
    for g in groups.unique().tolist():
        pos = [i for i in range(len(groups)) if groups[i] == g and correct[i] and keep[i]]
        neg = [i for i in range(len(groups)) if groups[i] == g and not correct[i] and keep[i]]
        if pos:
            w = torch.softmax(torch.stack([reward[i] / lam + log_v[i] for i in pos]), 0)
            positive = (w * score[pos]).sum()
        if neg:
            lse = torch.logsumexp(torch.stack([score[j] / tau + log_v[j] for j in neg]), 0)
            negative = tau * (lse - torch.logsumexp(log_v[neg], 0))
        if pos and neg:
            total = total + positive - negative
        elif pos and all_options:
            baseline = torch.softmax(log_v[pos], 0)
            total = total + ((w - baseline) * score[pos]).sum()
        elif neg and all_options:
            total = total - negative
    loss = -total / len(groups.unique())
    v = log_v.exp()
    kl_terms = v * ((data["old"] - lp) * token_w).sum(-1)
    kl_tokens = v * token_w.sum(-1)
    if kl_estimate == "minibatch":
        kl = kl_terms.sum() / kl_tokens.sum()
        return loss + beta0 * torch.relu(kl - 0.0) ** 2
    penalties = []
    for idx in microsteps:
        kl = kl_terms[idx].sum() / kl_tokens[idx].sum()
        penalties.append(beta0 * torch.relu(kl) ** 2)
    return loss + torch.stack(penalties).mean()


def split_gradient(data, correction, microsteps, config):
    """Scores pass, coefficients of the gathered scalars, one backward per micro-batch of
    ``surrogate_loss`` on each response's ``gradient_score``: what the actor does."""
    with torch.no_grad():
        gathered = ResponseScalars.concat(
            [scalars(data, idx, correction, step=k) for k, idx in enumerate(microsteps)]
        )
    score_coef, kl_coef, metrics = loss_coefficients(gathered, config)
    data["policy"].zero_grad()
    start = 0
    for k, idx in enumerate(microsteps):
        r = scalars(data, idx, correction, step=k)
        end = start + len(idx)
        surrogate_loss(
            r.gradient_score, r.kl_sum, score_coef[start:end], kl_coef[start:end]
        ).backward()
        start = end
    return data["policy"].weight.grad.clone(), metrics


@pytest.mark.parametrize("kl_estimate", ["minibatch", "microstep"])
@pytest.mark.parametrize("names", VARIANTS, ids="-".join)
def test_the_applied_gradient_is_the_corrected_objectives(names, kl_estimate):
    """Any cut into micro-batches (groups split over them) gives the reference's gradient."""
    correction = variant(*names)
    data = make_batch(seed=3)
    order = torch.randperm(len(data["correct"]), generator=torch.Generator().manual_seed(5))
    microsteps = [order[:7], order[7:13], order[13:]]
    options = dict(keep_all_wrong=True, all_correct_length_signal=True, kl_estimate=kl_estimate)
    grad, metrics = split_gradient(data, correction, microsteps, config_of(correction, **options))
    data["policy"].zero_grad()
    reference_loss(data, correction, microsteps, kl_estimate, all_options=True).backward()
    expected = data["policy"].weight.grad
    assert metrics["hinge_active"] > 0  # the penalty's gradient is part of it
    assert (grad - expected).abs().max() < 1e-10 * expected.abs().max()
    # and the one-piece loss's own autograd (the exactness harness's reference)
    parts = [scalars(data, idx, correction, step=k) for k, idx in enumerate(microsteps)]
    data["policy"].zero_grad()
    config = config_of(correction, **options)
    minibatch_loss(ResponseScalars.concat(parts), config)[0].backward()
    one_piece = data["policy"].weight.grad
    assert (one_piece - expected).abs().max() < 1e-10 * expected.abs().max()
    plain, _ = split_gradient(data, None, microsteps, config_of(None, **options))
    assert (grad - plain).abs().max() > 1e-3 * expected.abs().max()  # the correction acts


@pytest.mark.parametrize("names", VARIANTS, ids="-".join)
def test_each_variants_weights_are_the_documented_ones(names):
    """Token weights (clamped, zeroed, or the survivors' ratios), sequence weights and keep
    flags against the float-by-float restatement; the engines' data moves some of each."""
    correction = variant(*names)
    data = make_batch(seed=4)
    got = rollout_weights(correction, data["old"], data["engine"], data["mask"])
    token_w, log_v, keep = reference_weights(correction, data["old"], data["engine"], data["mask"])
    assert torch.allclose(got.tokens, token_w, rtol=1e-12, atol=0)
    assert torch.allclose(got.scalars.log_weight, log_v, rtol=1e-12, atol=0)
    assert torch.equal(got.scalars.keep, keep)
    assert 0 < got.scalars.corrected.sum() < got.scalars.units.sum()  # some, not all


def test_seq_mask_drops_a_response_as_if_it_had_not_been_sampled():
    """A masked response has no coefficient and its group's terms are those of the group
    without it (the prompt count Q unchanged)."""
    data = make_batch(seed=4)
    correction = variant("seq", "mask", "ratio")
    r = scalars(data, torch.arange(len(data["correct"])), correction)
    dropped = ~r.correction.keep
    assert dropped.any()
    coef, _, _ = loss_coefficients(r, config_of(correction, beta0=0.0))
    assert (coef[dropped] == 0).all()
    rewards = 1 - (r.num_tokens / MAX_T).clamp(max=1)
    kept = r.correction.keep
    both = drpo_objective(r.score, r.correct, r.group_id, rewards, 0.3, 10.0, keep=kept).loss
    groups = r.group_id[kept].unique().numel()
    alone = drpo_objective(
        r.score[kept], r.correct[kept], r.group_id[kept], rewards[kept], 0.3, 10.0
    )
    assert groups == r.group_id.unique().numel()  # no group vanished: Q is the same
    assert torch.allclose(both, alone.loss, rtol=1e-12)


def test_sequence_weights_reweight_the_group_sums():
    """DisCO (lambda = inf) with sequence weights v: the positives' weights are v / sum v and
    the negatives' term is tau log(sum v exp(s/tau) / sum v)."""
    scores = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    correct = torch.tensor([True, True, False, False])
    group = torch.zeros(4, dtype=torch.long)
    log_v = torch.tensor([math.log(3.0), 0.0, math.log(0.5), math.log(2.0)], dtype=torch.float64)
    terms = drpo_objective(
        scores, correct, group, torch.zeros_like(scores), math.inf, 10.0, log_weights=log_v
    )
    positive = (3 * -1.0 + 1 * -2.0) / 4
    negative = 10 * math.log((0.5 * math.exp(-0.05) + 2 * math.exp(-0.3)) / 2.5)
    assert terms.loss.item() == pytest.approx(-(positive - negative), rel=1e-12)


def test_effective_sample_size_per_group():
    """Sequence weights: (sum v)^2 / (n sum v^2) per group, mean and min over groups; token
    weights: the same over the group's tokens."""
    old = torch.zeros(8, 2, dtype=torch.float64)
    mask = torch.ones_like(old)
    # group 0: log rho 0, 0, 0, 0 (ESS 1); group 1: rho 1, 1, 4, 4 after the clip at 4
    engine = torch.zeros_like(old)
    engine[6:, :] = -2.0  # log rho = 4 nats, clipped to log 4
    correction = RolloutCorrection("seq", "clip", "ratio", 0.5, 4.0)
    c = rollout_weights(correction, old, engine, mask).scalars
    metrics = correction_metrics(c, torch.arange(2).repeat_interleave(4), mask.sum(-1))
    second = (1 + 1 + 4 + 4) ** 2 / (4 * (1 + 1 + 16 + 16))
    assert metrics["is_ess_min"].item() == pytest.approx(second, rel=1e-12)
    assert metrics["is_ess"].item() == pytest.approx((1 + second) / 2, rel=1e-12)
    assert metrics["is_filtered"].item() == pytest.approx(2 / 8)
    tokens = RolloutCorrection("token", "clip", "ratio", 0.5, 5.0)
    engine = torch.zeros_like(old)
    engine[0, 0] = -math.log(3.0)  # one token of group 0 at ratio 3
    t = correction_metrics(
        rollout_weights(tokens, old, engine, mask).scalars,
        torch.arange(2).repeat_interleave(4),
        mask.sum(-1),
    )
    assert t["is_ess_min"].item() == pytest.approx(10**2 / (8 * (7 + 9)), rel=1e-12)


def test_the_engines_kl_to_pi_old():
    """Token means of log mu - log pi_old (OpenRLHF's vllm_kl) and of r - 1 - log r."""
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    engine = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    c = rollout_weights(variant("token", "clip", "ratio"), old, engine, mask).scalars
    metrics = correction_metrics(c, torch.zeros(1, dtype=torch.long), mask.sum(-1))
    log_r = [0.5, -1.0]
    assert metrics["is_kl"].item() == pytest.approx(-sum(log_r) / 2, rel=1e-12)
    k3 = sum(math.exp(x) - 1 - x for x in log_r) / 2
    assert metrics["is_kl_k3"].item() == pytest.approx(k3, rel=1e-12)


def test_every_token_masked_leaves_no_kl_and_no_nan():
    data = make_batch()
    far = data["engine"] - 30 * data["mask"]  # every ratio e^30 and more: out of band
    loss, grad, metrics = loss_and_gradient(data, variant("token", "mask", "ratio"), far)
    assert metrics["kl"] == 0 and metrics["is_filtered"] == 1 and metrics["is_ess_min"] == 0
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_non_finite_engine_log_probs_are_refused():
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="not finite"):
        rollout_weights(
            variant("seq", "clip", "ratio"), old, torch.tensor([[0.0, -math.inf]]), mask
        )


REFUSED = [
    (("ppo", "mask", "ratio", [0.5, 5.0]), "must be in"),
    (("off", "clip", "ratio", [0.5, 5.0]), "do nothing without"),
    (("off", "mask", "tv", [0.5, 5.0]), "do nothing without"),
    (("off", "mask", "ratio", [2.0]), "do nothing without"),
    (("token", "clip", "binary_kl", [0.1]), "not a weight"),
    (("seq", "clip", "tv", [0.1]), "not a weight"),
    (("token", "mask", "binary_kl", [0.01, 0.1]), "from above only"),
    (("seq", "mask", "tv", [0.01, 0.1]), "from above only"),
    (("token", "clip", "ratio", [1.5, 5.0]), "leaves out 1"),
    (("seq", "mask", "ratio", [0.5]), "leaves out 1"),
    (("seq", "clip", "ratio", [0.2, 0.9]), "leaves out 1"),
    (("token", "mask", "ratio", [0.5, math.inf]), "finite"),
    (("token", "mask", "ratio", [-0.5, 2.0]), "0 <= LOW <= HIGH"),
    (("seq", "mask", "ratio", [3.0, 2.0]), "0 <= LOW <= HIGH"),
    (("seq", "mask", "ratio", [0.5, 2.0, 3.0]), "HIGH or LOW HIGH"),
]


@pytest.mark.parametrize(("flags", "why"), REFUSED, ids=lambda x: str(x))
def test_refused_combinations_say_why(flags, why):
    with pytest.raises(ValueError, match=why):
        rollout_correction(*flags)


@pytest.mark.parametrize("names", VARIANTS, ids="-".join)
def test_accepted_combinations(names):
    """Each variant with its band, or a single HIGH (LOW 0, as OpenRLHF reads it)."""
    band = variant(*names)
    assert refusal(*names, band.low, band.high) is None
    assert rollout_correction(*names, [band.high]) == RolloutCorrection(*names, 0.0, band.high)
    assert rollout_correction("off", "mask", "ratio", [0.5, 5.0]) == RolloutCorrection()


TINY = [
    *("--actor.model_name_or_path", "some/model", "--vllm.num_engines", "1"),
    *("--actor.num_gpus_per_node", "1"),
    *("--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "8"),
    *("--train.batch_size", "16", "--train.micro_batch_size", "4"),
]


def test_the_driver_reads_the_flags_into_drpos_config():
    seq_clip = [
        "--algo.advantage.is_correction_level",
        "seq",
        "--algo.advantage.is_correction_mode",
    ]
    options, argv = train.parse([*TINY, *seq_clip, "clip"])
    config = options.drpo
    assert config.rollout_correction == RolloutCorrection("seq", "clip", "ratio", 0.5, 5.0)
    assert "--algo.advantage.is_correction_level" in argv  # OpenRLHF still sees it
    config = train.parse(TINY)[0].drpo
    assert not config.rollout_correction.enabled  # the released runs: off
    baseline_flags = ["--shaping.method", "rloo_lp", "--shaping.params", "alpha=0.2"]
    baseline = train.parse([*TINY, *baseline_flags, *seq_clip[:2]])[0].drpo
    assert not baseline.rollout_correction.enabled  # PPO's own correction, by its flags


@pytest.mark.parametrize(("flags", "why"), REFUSED[1:5], ids=lambda x: str(x))
def test_the_driver_refuses_before_launch(flags, why, capsys):
    level, mode, gating, band = flags
    argv = [*TINY, "--algo.advantage.is_correction_level", level]
    argv += ["--algo.advantage.is_correction_mode", mode]
    argv += ["--algo.advantage.is_correction_gating", gating]
    argv += ["--algo.advantage.is_correction_threshold", *map(str, band)]
    with pytest.raises(SystemExit):
        train.parse(argv)
    assert why in capsys.readouterr().err


def test_the_actor_refuses_a_rollout_without_the_engines_log_probs():
    from drpo_openrlhf.update.actor_trainer import DRPOActorTrainer

    trainer = SimpleNamespace(drpo=DRPOConfig(rollout_correction=variant("seq", "clip", "ratio")))
    with pytest.raises(ValueError, match="without the vLLM engines' log-probs"):
        DRPOActorTrainer._rollout_weights(trainer, SimpleNamespace(rollout_log_probs=None))
    trainer.drpo = DRPOConfig()
    assert (
        DRPOActorTrainer._rollout_weights(trainer, SimpleNamespace(rollout_log_probs=None)) is None
    )
