"""The DRPO/DisCO algorithm core: plain PyTorch, no OpenRLHF import.

Every training path (the OpenRLHF actor, single-process runs, tests) calls these functions.
"""

from drpo_openrlhf.algo.config import DRPOConfig
from drpo_openrlhf.algo.length_reward import LENGTH_REWARDS, length_reward
from drpo_openrlhf.algo.minibatch import (
    ResponseScalars,
    group_score_coefficients,
    loss_coefficients,
    microstep_coefficients,
    minibatch_loss,
    response_scalars,
    surrogate_loss,
)
from drpo_openrlhf.algo.objective import DRPOTerms, drpo_loss, drpo_objective
from drpo_openrlhf.algo.scores import kl_sums, sequence_scores
from drpo_openrlhf.algo.trust_region import kl_estimate, kl_penalty
from drpo_openrlhf.algo.weights import pass_rate_lambda, positive_log_weights, positive_weights

__all__ = [
    "LENGTH_REWARDS",
    "DRPOConfig",
    "DRPOTerms",
    "ResponseScalars",
    "drpo_loss",
    "drpo_objective",
    "group_score_coefficients",
    "kl_estimate",
    "kl_penalty",
    "kl_sums",
    "length_reward",
    "loss_coefficients",
    "microstep_coefficients",
    "minibatch_loss",
    "pass_rate_lambda",
    "positive_log_weights",
    "positive_weights",
    "response_scalars",
    "sequence_scores",
    "surrogate_loss",
]
