"""Weights of the correct responses: the closed-form optimum ``P*_q`` of paper Eq. (6).

``w_hat(o) = exp(r_l(o)/lambda) / sum_{o' in S+_q} exp(r_l(o')/lambda)``: a softmax of the
length rewards normalised only among the prompt's correct responses, computed in the log
domain so that ``lambda`` down to 1e-3 neither overflows nor underflows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from drpo_openrlhf.algo.groups import dense_group_index, segment_logsumexp, segment_sum


def positive_log_weights(
    length_rewards: Tensor,
    correct: Tensor,
    group_ids: Tensor,
    lam: float | Tensor,
    log_prior: Tensor | None = None,
) -> Tensor:
    """``log w_hat`` for correct responses and ``-inf`` for incorrect ones, shape (B,).

    ``lam`` is a float or a per-response tensor (the same value within a prompt);
    ``lam = inf`` gives equal weights ``1/|S+_q|``, i.e. DisCO. Computed in float64 (these are
    per-response scalars): ``r/lambda`` reaches 1e3 for lambda = 1e-3, where float32 rounding
    alone would move the weights by 1e-5. ``log_prior``: a log weight added to each logit,
    the importance weight of a response sampled from another distribution than pi_old
    (``rollout_correction``; 0 changes nothing).
    """
    dtype = length_rewards.dtype
    length_rewards = length_rewards.double()
    lam_t = torch.as_tensor(lam, dtype=torch.float64, device=length_rewards.device)
    if (lam_t <= 0).any() or torch.isnan(lam_t).any():
        raise ValueError(f"lambda must be positive (inf allowed), got {lam}")
    index, num_groups = dense_group_index(group_ids)
    logits = length_rewards / lam_t  # r / inf == 0: equal weights without a special case
    if log_prior is not None:
        logits = logits + log_prior.double()
    log_norm = segment_logsumexp(logits, index, num_groups, correct)
    neg_inf = logits.new_full((), float("-inf"))
    log_w = torch.where(correct, logits - torch.where(correct, log_norm[index], 0.0), neg_inf)
    return log_w.to(dtype)


def positive_weights(
    length_rewards: Tensor, correct: Tensor, group_ids: Tensor, lam: float | Tensor
) -> Tensor:
    """``w_hat`` for correct responses (summing to 1 per prompt) and 0 for incorrect ones."""
    return positive_log_weights(length_rewards, correct, group_ids, lam).exp()


def pass_rate_lambda(lam: float, correct: Tensor, group_ids: Tensor, prior: float = 0.0) -> Tensor:
    """Per-response ``lambda_q = lambda / p_q``: gentler length pressure on hard prompts.

    The paper's "future work" direction: a prompt solved by 1 of 8 samples keeps its rare
    correct answers almost equally weighted (``8 lambda``), an easy one gets ``lambda``.
    ``p_q = (c_q + prior/2) / (n_q + prior)`` is the pass rate shrunk towards 1/2 (the mean of
    a Beta(prior/2, prior/2) belief, ``prior`` pseudo-samples): with ``prior = 0`` it is the
    group's own rate, which at ``n = 8`` moves ``lambda_q`` by 2x when one sample of a hard
    prompt changes; a prior of a few samples caps ``lambda_q`` at
    ``lambda (n + prior) / (1 + prior/2)`` and keeps it above ``lambda``.
    Prompts with no correct response have no weights to compute; they get ``lambda``.
    """
    if not (prior >= 0 and math.isfinite(prior)):
        raise ValueError(f"prior must be a finite number >= 0, got {prior}")
    index, num_groups = dense_group_index(group_ids)
    hits = segment_sum(correct.double(), index, num_groups)
    size = segment_sum(torch.ones_like(correct, dtype=torch.float64), index, num_groups)
    rate = (hits + prior / 2) / (size + prior)
    per_group = torch.where(hits > 0, lam / rate.clamp(min=1e-12), torch.full_like(rate, lam))
    return per_group[index]
