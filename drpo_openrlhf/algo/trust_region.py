"""The trust region ``KL(pi_old || pi_theta) <= delta`` handled by a squared-hinge penalty."""

from __future__ import annotations

from torch import Tensor

from drpo_openrlhf.algo.scores import kl_sums


def kl_estimate(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """Token-mean estimate of ``KL(pi_old || pi_theta)`` over all masked tokens (Algorithm 1)."""
    return kl_sums(log_probs, old_log_probs, mask).sum() / mask.sum()


def kl_penalty(kl: Tensor, delta: float, beta0: float) -> Tensor:
    """The paper's penalty ``beta0 * [KL - delta]_+^2``.

    Its gradient is ``2 beta0 [KL - delta]_+ grad KL`` (Algorithm 1, ``G2``). The authors'
    released code applies ``beta0 [KL - delta]_+ grad KL``, half of it; ``DRPOConfig``
    reproduces that by default through ``penalty_form="authors"``.
    """
    return beta0 * (kl - delta).clamp(min=0.0).square()
