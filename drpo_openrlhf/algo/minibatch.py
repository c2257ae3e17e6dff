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
from drpo_openrlhf.algo.scores import kl_sums, sequence_scores
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
    """

    score: Tensor
    kl_sum: Tensor
    num_tokens: Tensor
    correct: Tensor
    group_id: Tensor
    microstep: Tensor
    preference: Tensor | None = None

    def __post_init__(self) -> None:
        shapes = {
            f.name: tuple(getattr(self, f.name).shape)
            for f in fields(self)
            if getattr(self, f.name) is not None
        }
        if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
            raise ValueError(f"ResponseScalars fields must be 1-D of one length, got {shapes}")

    @staticmethod
    def concat(parts: list[ResponseScalars]) -> ResponseScalars:
        preferences = [p.preference for p in parts if p.preference is not None]
        if preferences and len(preferences) != len(parts):
            raise ValueError("some parts have no preference")
        return ResponseScalars(
            score=torch.cat([p.score for p in parts]),
            kl_sum=torch.cat([p.kl_sum for p in parts]),
            num_tokens=torch.cat([p.num_tokens for p in parts]),
            correct=torch.cat([p.correct for p in parts]),
            group_id=torch.cat([p.group_id for p in parts]),
            microstep=torch.cat([p.microstep for p in parts]),
            preference=torch.cat(preferences) if preferences else None,
        )


def response_scalars(
    log_probs: Tensor,
    old_log_probs: Tensor,
    mask: Tensor,
    correct: Tensor,
    group_ids: Tensor,
    microstep: int = 0,
    preference: Tensor | None = None,
) -> ResponseScalars:
    """Scalars of a micro-batch of responses from ``(B, T)`` token log-probs and mask;
    ``preference``: their positive rewards, unless it is the length reward."""
    mask = mask.to(log_probs.dtype)
    return ResponseScalars(
        score=sequence_scores(log_probs, mask),
        kl_sum=kl_sums(log_probs, old_log_probs, mask),
        num_tokens=mask.sum(dim=-1),
        correct=correct.bool(),
        group_id=group_ids.long(),
        microstep=torch.full_like(group_ids, microstep, dtype=torch.long),
        preference=preference,
    )


def positive_rewards(r: ResponseScalars, config: DRPOConfig, max_len: float) -> Tensor:
    """What ranks the correct responses: ``r_l`` of their token counts (C = ``config.max_len``
    or ``max_len``), or the positive reward they carry (``config.positive_reward``)."""
    if config.length_positive_reward:
        c = config.max_len if config.max_len is not None else max_len
        return length_reward(r.num_tokens.to(r.score.dtype), c, config.length_reward)
    if r.preference is None:
        raise ValueError(
            f"positive reward {config.positive_reward!r}: the responses carry no score of it "
            "(it is computed where the rewards run: rewards/positive_engine.py)"
        )
    return r.preference.to(r.score.dtype)


def _kl_penalty_term(r: ResponseScalars, config: DRPOConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Penalty, KL estimate and hinge-active fraction, per ``config.kl_estimate``."""
    beta0 = config.effective_beta0
    if config.kl_estimate == "minibatch":
        kl = r.kl_sum.sum() / r.num_tokens.sum()
        return kl_penalty(kl, config.delta, beta0), kl, (kl > config.delta).to(kl.dtype)
    index, num_steps = dense_group_index(r.microstep)
    per_step = segment_sum(r.kl_sum, index, num_steps) / segment_sum(
        r.num_tokens.to(r.kl_sum.dtype), index, num_steps
    )
    penalty = kl_penalty(per_step, config.delta, beta0).mean()
    return penalty, per_step.mean(), (per_step > config.delta).to(per_step.dtype).mean()


def _mean_or_nan(values: Tensor, mask: Tensor) -> Tensor:
    return values[mask].mean() if mask.any() else values.new_full((), math.nan)


def minibatch_loss(
    r: ResponseScalars, config: DRPOConfig, max_len: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """True mini-batch loss ``-(1/Q) sum_q J_q + penalty(KL)`` and its metrics.

    ``max_len`` is the length-reward ``C`` when ``config.max_len`` is unset.
    """
    lengths = r.num_tokens.to(r.score.dtype)
    rewards = positive_rewards(r, config, max_len)
    terms = drpo_objective(
        r.score,
        r.correct,
        r.group_id,
        rewards,
        config.lam,
        config.tau,
        **config.objective_options(),
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
    return terms.loss + penalty, metrics


def loss_coefficients(
    r: ResponseScalars, config: DRPOConfig, max_len: float
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
        r, score=score, kl_sum=kl_sum, num_tokens=r.num_tokens.double(), preference=preference
    )
    loss, metrics = minibatch_loss(leaf, config, max_len)
    score_coef, kl_coef = torch.autograd.grad(loss, [score, kl_sum])
    metrics["loss"] = loss.detach()
    return score_coef, kl_coef, metrics


def microstep_coefficients(
    r: ResponseScalars, config: DRPOConfig, max_len: float, num_groups: int, num_microsteps: int
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
    score_coef, kl_coef, _ = loss_coefficients(r, config, max_len)
    return score_coef * (local_groups / num_groups), kl_coef / num_microsteps


def group_score_coefficients(
    r: ResponseScalars, config: DRPOConfig, max_len: float, num_groups: int
) -> Tensor:
    """``dL/ds_i`` of the mini-batch loss for responses that form whole prompt groups, from
    their own scalars, under either KL estimate.

    The penalty depends on the scores not at all, and the objective is a sum over groups
    divided by the mini-batch's ``num_groups``: the coefficients of the groups' own objective
    (penalty off), rescaled by their share of the groups, are the mini-batch's.
    """
    objective_only = replace(config, beta0=0.0)
    score_coef, _, _ = loss_coefficients(r, objective_only, max_len)
    return score_coef * (count_distinct(r.group_id) / num_groups)


def surrogate_loss(score: Tensor, kl_sum: Tensor, score_coef: Tensor, kl_coef: Tensor) -> Tensor:
    """Linear stand-in whose gradient is this micro-batch's share of ``grad L``."""
    dtype = score.dtype
    return (score_coef.to(dtype) * score).sum() + (kl_coef.to(dtype) * kl_sum).sum()
