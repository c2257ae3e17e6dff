"""The DRPO loss of one mini-batch, and its exact split over micro-batches and ranks.

The mini-batch objective (Algorithm 1) depends on each response only through a few scalars:
its score ``s``, its summed KL and its token count (correctness and prompt id are data).
``minibatch_loss`` computes the true loss from those scalars in one piece. Because the loss
reaches the model parameters only through ``s_i`` and ``kl_i``, the chain rule gives

    grad L = sum_i dL/ds_i * grad s_i + sum_i dL/dkl_i * grad kl_i,

so once the coefficients ``dL/ds_i`` and ``dL/dkl_i`` are known (from the scalars of the
whole mini-batch, gathered across ranks), each micro-batch can back-propagate the linear
``surrogate_loss`` of its own responses and the accumulated gradient equals ``grad L``
exactly, whatever the micro-batching, packing or data-parallel layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from drpo_openrlhf.algo.config import DRPOConfig
from drpo_openrlhf.algo.groups import count_distinct, dense_group_index, segment_sum
from drpo_openrlhf.algo.length_reward import length_reward
from drpo_openrlhf.algo.objective import drpo_objective
from drpo_openrlhf.algo.rollout_correction import (
    CorrectionScalars,
    RolloutWeights,
    correction_metrics,
    kl_parts,
)
from drpo_openrlhf.algo.scores import kl_sums, masked_sum, sequence_scores
from drpo_openrlhf.algo.trust_region import kl_penalty


@dataclass(frozen=True)
class ResponseScalars:
    """Per-response scalars, each a 1-D tensor over the responses of a (mini-)batch.

    ``num_tokens`` is the response length ``|o|`` (EOS included, as in the released code);
    it is both the length-reward input and the KL denominator. ``microstep`` is the global
    micro-step a response is trained in (only used by ``kl_estimate="microstep"``).
    ``preference`` is each response's positive reward when it is not the length reward
    (``DRPOConfig.positive_reward``): data, like correctness, scored where the rewards run;
    ``None`` when the length reward ranks the correct responses.

    Under a rollout correction (``rollout_correction``) ``correction`` holds the responses'
    summaries and ``kl_sum`` is token-weighted; ``weighted_score``, the mean of the
    token-weighted log-probs, is what a micro-batch back-propagates in place of ``score``
    (``gradient_score``), whose value the objective reads. Only the forward's own scalars
    carry it: the gathered ones need none.
    """

    score: Tensor
    kl_sum: Tensor
    num_tokens: Tensor
    correct: Tensor
    group_id: Tensor
    microstep: Tensor
    preference: Tensor | None = None
    weighted_score: Tensor | None = None
    correction: CorrectionScalars | None = None

    def __post_init__(self) -> None:
        shapes = {
            f.name: tuple(getattr(self, f.name).shape)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        if self.correction is not None:
            shapes["correction"] = (len(self.correction),)
        if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
            raise ValueError(f"ResponseScalars fields must be 1-D of one length, got {shapes}")

    @property
    def gradient_score(self) -> Tensor:
        """The score a micro-batch back-propagates: token-weighted under a token correction."""
        return self.score if self.weighted_score is None else self.weighted_score

    @staticmethod
    def concat(parts: list[ResponseScalars]) -> ResponseScalars:
        preferences = [p.preference for p in parts if p.preference is not None]
        weighted = [p.weighted_score for p in parts if p.weighted_score is not None]
        corrections = [p.correction for p in parts if p.correction is not None]
        present = {
            "preference": len(preferences),
            "weighted_score": len(weighted),
            "correction": len(corrections),
        }
        for name, count in present.items():
            if count and count != len(parts):
                raise ValueError(f"some parts have no {name}")
        return ResponseScalars(
            score=torch.cat([p.score for p in parts]),
            kl_sum=torch.cat([p.kl_sum for p in parts]),
            num_tokens=torch.cat([p.num_tokens for p in parts]),
            correct=torch.cat([p.correct for p in parts]),
            group_id=torch.cat([p.group_id for p in parts]),
            microstep=torch.cat([p.microstep for p in parts]),
            preference=torch.cat(preferences) if preferences else None,
            weighted_score=torch.cat(weighted) if weighted else None,
            correction=CorrectionScalars.concat(corrections) if corrections else None,
        )


def response_scalars(
    log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    correct: Tensor,
    group_ids: Tensor,
    microstep: int = 0,
    preference: Tensor | None = None,
    weights: RolloutWeights | None = None,
) -> ResponseScalars:
    """Scalars of a micro-batch of responses from ``(B, T)`` token log-probs and mask;
    ``preference``: their positive rewards, unless it is the length reward; ``weights``: the
    rollout correction's (``rollout_correction.rollout_weights``), whose token weights
    multiply each token's term in the KL sum and in the score's gradient."""
    mask = mask.to(log_probs.dtype)
    score = sequence_scores(log_probs, mask)
    kl_sum, weighted_score, correction = kl_sums(log_probs, old_log_probs, mask), None, None
    if weights is not None:
        tokens = weights.tokens.to(log_probs.dtype)  # exactly the mask at weight 1
        kl_sum = masked_sum(old_log_probs - log_probs, tokens)
        weighted_score = masked_sum(log_probs, tokens) / mask.sum(dim=-1)
        correction = weights.scalars
    return ResponseScalars(
        score=score,
        kl_sum=kl_sum,
        num_tokens=mask.sum(dim=-1),
        correct=correct.bool(),
        group_id=group_ids.long(),
        microstep=torch.full_like(group_ids, microstep, dtype=torch.long),
        preference=preference,
        weighted_score=weighted_score,
        correction=correction,
    )


def positive_rewards(r: ResponseScalars, config: DRPOConfig) -> Tensor:
    """What ranks the correct responses: ``r_l`` of their token counts (C =
    ``config.max_len``), or the positive reward they carry (``config.positive_reward``)."""
    if config.length_positive_reward:
        lengths = r.num_tokens.to(r.score.dtype)
        return length_reward(lengths, config.length_c, config.length_reward)
    if r.preference is None:
        raise ValueError(
            f"positive reward {config.positive_reward!r}: the responses carry no score of it "
            "(it is computed where the rewards run: rewards/positive_engine.py)"
        )
    return r.preference.to(r.score.dtype)


def _nonzero(denominator: Tensor) -> Tensor:
    """A KL's token count, 1 where none is left (every token masked: no KL, no penalty)."""
    return torch.where(denominator > 0, denominator, 1.0)


def _kl_penalty_term(r: ResponseScalars, config: DRPOConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Penalty, KL estimate and hinge-active fraction, per ``config.kl_estimate``; under a
    rollout correction the estimate is weighted (``rollout_correction.kl_parts``)."""
    beta0 = config.effective_beta0
    kl_sum, tokens = r.kl_sum, r.num_tokens.to(r.kl_sum.dtype)
    if r.correction is not None:
        kl_sum, tokens = kl_parts(r.kl_sum, r.correction)
    if config.kl_estimate == "minibatch":
        kl = kl_sum.sum() / _nonzero(tokens.sum())
        return kl_penalty(kl, config.delta, beta0), kl, (kl > config.delta).to(kl.dtype)
    index, num_steps = dense_group_index(r.microstep)
    per_step = segment_sum(kl_sum, index, num_steps) / _nonzero(
        segment_sum(tokens, index, num_steps)
    )
    penalty = kl_penalty(per_step, config.delta, beta0).mean()
    return penalty, per_step.mean(), (per_step > config.delta).to(per_step.dtype).mean()


def _objective_score(r: ResponseScalars) -> Tensor:
    """The score's value with the gradient of ``weighted_score`` where there is one (a token
    correction weights the score's tokens in its gradient only): ``w - w.detach()`` is 0 in
    every float, so the value is the plain score's, bit for bit."""
    if r.weighted_score is None:
        return r.score
    return r.score.detach() + (r.weighted_score - r.weighted_score.detach())


def _mean_or_nan(values: Tensor, mask: Tensor) -> Tensor:
    return values[mask].mean() if mask.any() else values.new_full((), math.nan)


def minibatch_loss(r: ResponseScalars, config: DRPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """True mini-batch loss ``-(1/Q) sum_q J_q + penalty(KL)`` and its metrics.

    Its gradient is the corrected objective's under a rollout correction too: the scores'
    values, their ``weighted_score``'s gradient.
    """
    lengths = r.num_tokens.to(r.score.dtype)
    rewards = positive_rewards(r, config)
    correction = {}
    if r.correction is not None:
        correction = dict(log_weights=r.correction.log_weight, keep=r.correction.keep)
    terms = drpo_objective(
        _objective_score(r),
        r.correct,
        r.group_id,
        rewards,
        config.lam,
        config.tau,
        **config.objective_options(),
        **correction,
    )
    penalty, kl, hinge = _kl_penalty_term(r, config)
    detached = lengths.detach()
    metrics = {
        "objective": -terms.loss.detach(),
        "positive_term": terms.positive_term,
        "negative_term": terms.negative_term,
        "valid_prompt_fraction": terms.valid_fraction,
        "effective_positives": terms.effective_positives,
        "kl": kl.detach(),
        "kl_penalty": penalty.detach(),
        "hinge_active": hinge.detach(),
        "response_length": detached.mean(),
        "response_length_correct": _mean_or_nan(detached, r.correct),
        "response_length_incorrect": _mean_or_nan(detached, ~r.correct),
        "positive_reward_correct": _mean_or_nan(rewards.detach(), r.correct),
    }
    if r.correction is not None:
        metrics |= correction_metrics(r.correction, r.group_id, r.num_tokens)
    return terms.loss + penalty, metrics


def loss_coefficients(
    r: ResponseScalars, config: DRPOConfig
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``dL/ds_i`` and ``dL/dkl_i`` of the whole mini-batch (float64), plus its metrics.

    Computed by autograd through ``minibatch_loss`` itself, so the split gradient can never
    drift from the one-piece objective. Non-finite scalars (a policy producing NaN or inf
    log-probs) raise ``ValueError`` here, before any of them reaches a gradient.
    """
    bad = ~(torch.isfinite(r.score) & torch.isfinite(r.kl_sum))
    if bad.any():
        groups = sorted(set(r.group_id[bad].tolist()))
        raise ValueError(
            f"non-finite log-probs in {int(bad.sum())} of {bad.numel()} responses (prompt "
            f"groups {groups[:8]}): the policy produced NaN/inf; this update was not applied"
        )
    score = r.score.detach().double().requires_grad_(True)
    kl_sum = r.kl_sum.detach().double().requires_grad_(True)
    preference = None if r.preference is None else r.preference.double()
    leaf = replace(
        r,
        score=score,
        kl_sum=kl_sum,
        num_tokens=r.num_tokens.double(),
        preference=preference,
        weighted_score=None,  # dL/ds: the scores' own coefficients
    )
    loss, metrics = minibatch_loss(leaf, config)
    score_coef, kl_coef = torch.autograd.grad(loss, [score, kl_sum])
    metrics["loss"] = loss.detach()
    return score_coef, kl_coef, metrics


def microstep_coefficients(
    r: ResponseScalars, config: DRPOConfig, num_groups: int, num_microsteps: int
) -> tuple[Tensor, Tensor]:
    """``dL/ds_i`` and ``dL/dkl_i`` of the mini-batch loss from the scalars of one global
    micro-step alone, for ``kl_estimate="microstep"`` when every prompt group of the
    mini-batch lies inside one micro-step.

    Then a micro-step's responses meet the rest of the mini-batch only through the
    normalisers: the objective is a sum over groups divided by the mini-batch's
    ``num_groups``, the penalty a sum over micro-steps divided by ``num_microsteps``. The
    coefficients of the micro-step's own loss are rescaled accordingly, so no scores pass over
    the whole mini-batch is needed before the first backward.
    """
    if config.kl_estimate != "microstep":
        raise ValueError("per-micro-step coefficients need kl_estimate='microstep'")
    if count_distinct(r.microstep) != 1:
        raise ValueError("microstep_coefficients takes the responses of one micro-step")
    local_groups = count_distinct(r.group_id)
    score_coef, kl_coef, _ = loss_coefficients(r, config)
    return score_coef * (local_groups / num_groups), kl_coef / num_microsteps


def group_score_coefficients(r: ResponseScalars, config: DRPOConfig, num_groups: int) -> Tensor:
    """``dL/ds_i`` of the mini-batch loss for responses that form whole prompt groups, from
    their own scalars, under either KL estimate.

    The penalty depends on the scores not at all, and the objective is a sum over groups
    divided by the mini-batch's ``num_groups``: the coefficients of the groups' own objective
    (penalty off), rescaled by their share of the groups, are the mini-batch's.
    """
    objective_only = replace(config, beta0=0.0)
    score_coef, _, _ = loss_coefficients(r, objective_only)
    return score_coef * (count_distinct(r.group_id) / num_groups)


def surrogate_loss(score: Tensor, kl_sum: Tensor, score_coef: Tensor, kl_coef: Tensor) -> Tensor:
    """Linear stand-in whose gradient is this micro-batch's share of ``grad L``."""
    dtype = score.dtype
    return (score_coef.to(dtype) * score).sum() + (kl_coef.to(dtype) * kl_sum).sum()
