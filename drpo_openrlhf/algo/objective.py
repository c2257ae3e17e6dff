"""The DRPO objective over a batch of prompt groups (paper Eq. 8, Algorithm 1's ``G1``).

Per prompt ``q`` with correct set ``S+`` and incorrect set ``S-``::

    J_q = sum_{o in S+} w_hat(o) s(o)  -  tau * log mean_{o' in S-} exp(s(o') / tau)

and the loss to minimise is ``-(1/Q) sum_q J_q`` over *all* ``Q`` prompts of the batch.
Prompts without both kinds of responses contribute 0 but still count in ``Q``, as in the
authors' released code. The value computed here is the true objective, not a surrogate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from drpo_openrlhf.algo.config import ObjectiveOptions
from drpo_openrlhf.algo.groups import dense_group_index, segment_logsumexp, segment_sum
from drpo_openrlhf.algo.learnable import group_has_signal
from drpo_openrlhf.algo.rollout_correction import group_normalised
from drpo_openrlhf.algo.weights import pass_rate_lambda, positive_log_weights

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack


@dataclass(frozen=True)
class DRPOTerms:
    """The batch loss and what to log about it (diagnostics are detached)."""

    loss: Tensor
    positive_term: Tensor
    negative_term: Tensor
    valid_fraction: Tensor
    effective_positives: Tensor


# Over 80 lines with its docstring, which documents every option; its body (65 lines) is one
# computation, read top to bottom against the paper's objective.
def drpo_objective(
    scores: Tensor,
    correct: Tensor,
    group_ids: Tensor,
    length_rewards: Tensor,
    lam: float,
    tau: float,
    *,
    keep_all_wrong: bool = False,
    all_correct_length_signal: bool = False,
    lambda_by_pass_rate: bool = False,
    pass_rate_prior: float = 0.0,
    log_weights: Tensor | None = None,
    keep: Tensor | None = None,
) -> DRPOTerms:
    """The DRPO loss of a batch and its diagnostics.

    Options (all off by default, i.e. the authors' behaviour):

    - ``keep_all_wrong``: prompts with only incorrect responses keep their negative term.
    - ``all_correct_length_signal``: prompts with only correct responses contribute
      ``sum (w_hat - 1/|S+|) s``: a zero-mean signal that teaches concision on easy prompts
      without moving the overall likelihood of correct answers.
    - ``lambda_by_pass_rate``: ``lambda_q = lambda / pass_rate(q)``, the rate shrunk by
      ``pass_rate_prior`` pseudo-samples towards 1/2 (see ``pass_rate_lambda``).

    Rollout correction (``rollout_correction``; ``None``: the uncorrected objective, which
    zero log weights and ``keep`` everywhere reproduce bit for bit):

    - ``log_weights``: each response's log importance weight ``log rho``, self-normalised
      within its group: added to the positives' softmax logits, and the negatives' mean
      becomes ``sum rho exp(s/tau) / sum rho``; the all-correct signal's baseline
      ``1/|S+|`` becomes ``rho / sum_{S+} rho``.
    - ``keep``: responses outside it leave their group's sums, as if never sampled (a group
      left without a correct or an incorrect response is treated as such; it still counts
      in ``Q``). ``lambda_by_pass_rate`` still reads the group's sampled pass rate.
    """
    if not tau > 0:
        raise ValueError(f"tau must be positive, got {tau}")
    correct = correct.bool()
    if not (scores.shape == correct.shape == group_ids.shape == length_rewards.shape):
        raise ValueError("scores, correct, group_ids and length_rewards must have one shape (B,)")
    index, num_groups = dense_group_index(group_ids)
    sampled = correct
    incorrect = ~correct
    if keep is not None:
        correct, incorrect = correct & keep, incorrect & keep
    n_pos = segment_sum(correct.to(scores.dtype), index, num_groups)
    n_neg = segment_sum(incorrect.to(scores.dtype), index, num_groups)
    has_pos, has_neg = n_pos > 0, n_neg > 0

    group_lam: float | Tensor = lam
    if lambda_by_pass_rate:
        group_lam = pass_rate_lambda(lam, sampled, group_ids, pass_rate_prior)
    rewards = length_rewards.to(scores.dtype)
    log_w = positive_log_weights(rewards, correct, group_ids, group_lam, log_weights)
    w = log_w.exp()
    positive = segment_sum(w * scores, index, num_groups)
    negative, baseline = _negative_and_baseline(
        scores, tau, correct, incorrect, index, num_groups, n_pos, n_neg, log_weights
    )

    valid = has_pos & has_neg
    # each kind of group's term: a mixed group's, an all-wrong group's negative term, an
    # all-correct group's zero-mean length signal; ``group_has_signal`` says which count
    centred = (w - baseline) * scores
    easy = segment_sum(centred, index, num_groups)
    term = torch.where(valid, positive - negative, torch.where(has_pos, easy, -negative))
    counted = group_has_signal(
        has_pos,
        has_neg,
        keep_all_wrong=keep_all_wrong,
        all_correct_length_signal=all_correct_length_signal,
    )
    per_group = torch.where(counted, term, 0.0)

    loss = -per_group.sum() / num_groups
    entropy = -segment_sum(torch.where(correct, w * log_w, 0.0), index, num_groups)
    with torch.no_grad():  # diagnostics
        effective = entropy.exp()[has_pos].mean() if has_pos.any() else scores.new_zeros(())
        return DRPOTerms(
            loss=loss,
            positive_term=torch.where(valid, positive, 0.0).sum() / num_groups,
            negative_term=torch.where(valid, negative, 0.0).sum() / num_groups,
            valid_fraction=valid.to(scores.dtype).mean(),
            effective_positives=effective,
        )


def _negative_and_baseline(
    scores: Tensor,
    tau: float,
    correct: Tensor,
    incorrect: Tensor,
    index: Tensor,
    num_groups: int,
    n_pos: Tensor,
    n_neg: Tensor,
    log_weights: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Per group, ``tau * log mean exp(s/tau)`` over its incorrect responses (0 without any),
    and per response the all-correct signal's baseline ``1/|S+|`` on the correct ones; both
    weighted by ``rho`` under a rollout correction (``lse(s/tau + log rho) - lse(log rho)``,
    ``rho / sum_{S+} rho``)."""
    has_neg = n_neg > 0
    if log_weights is None:
        lse = segment_logsumexp(scores / tau, index, num_groups, incorrect)
        log_n_neg = torch.log(n_neg.clamp(min=1.0))
        baseline = torch.where(correct, 1.0 / n_pos.clamp(min=1.0)[index], 0.0)
    else:
        log_weights = log_weights.to(scores.dtype)
        lse = segment_logsumexp(scores / tau + log_weights, index, num_groups, incorrect)
        norm = segment_logsumexp(log_weights, index, num_groups, incorrect)
        log_n_neg = torch.where(has_neg, norm, 0.0)
        baseline = group_normalised(log_weights, correct, index, num_groups)
    return tau * torch.where(has_neg, lse - log_n_neg, 0.0), baseline


def drpo_loss(
    scores: Tensor,
    correct: Tensor,
    group_ids: Tensor,
    length_rewards: Tensor,
    lam: float = 0.1,
    tau: float = 10.0,
    **options: Unpack[ObjectiveOptions],
) -> Tensor:
    """Scalar loss ``-(1/Q) sum_q J_q``; ``lam=math.inf`` is DisCO. See ``drpo_objective``."""
    return drpo_objective(scores, correct, group_ids, length_rewards, lam, tau, **options).loss
