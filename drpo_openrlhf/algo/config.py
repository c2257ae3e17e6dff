"""DRPO hyper-parameters, with defaults that reproduce the authors' released runs except the KL
estimate (``kl_estimate``: Algorithm 1's by default, the released code's on request)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypedDict

from drpo_openrlhf.algo.length_reward import LENGTH_REWARDS
from drpo_openrlhf.algo.rollout_correction import RolloutCorrection

PENALTY_FORMS = ("authors", "paper")
KL_ESTIMATES = ("minibatch", "microstep")
LENGTH_POSITIVE_REWARD = "length"  # the positive reward that is r_l of the token counts


def is_length_positive_reward(spec: str) -> bool:
    """``spec`` is the length reward alone: the actor computes it from token counts, so no
    vLLM engine loads or scores it."""
    return spec.strip() == LENGTH_POSITIVE_REWARD


class ObjectiveOptions(TypedDict, total=False):
    """The objective's switches (``drpo_objective``'s keyword options), all off by default."""

    keep_all_wrong: bool
    all_correct_length_signal: bool
    lambda_by_pass_rate: bool
    pass_rate_prior: float


@dataclass(frozen=True)
class DRPOConfig:
    """Everything the DRPO loss needs besides the data.

    - ``lam``: length-reward temperature lambda (``math.inf`` = DisCO). Released runs: 0.1.
    - ``tau``: temperature of the negatives' log-sum-exp. 10.
    - ``delta``, ``beta0``: trust-region radius and penalty constant. 1e-4 and 1e3.
    - ``penalty_form``: ``"authors"`` applies ``beta0 [KL - delta]_+ grad KL`` as the released
      code does (the penalty ``(beta0/2) [KL - delta]_+^2``); ``"paper"`` applies the
      paper's ``beta0 [KL - delta]_+^2``, twice that gradient.
    - ``kl_estimate``: ``"minibatch"`` takes the token-mean KL over the whole mini-batch, as
      Algorithm 1 writes it, so the update does not depend on micro-batching or sharding;
      ``"microstep"`` averages one penalty per (global) micro-step, as the released code does
      (the default deviates from the released runs here, on purpose).
    - ``length_reward``, ``max_len``: the shape of ``r_l`` and its ``C``. A run's options
      resolve ``C`` once (``--drpo.max_len``, else the generation budget
      ``--rollout.max_new_tokens``, the authors' choice, else ``--data.max_len``); ``None``
      is unresolved, which ``length_c`` refuses.
    - ``positive_reward``: what ranks a prompt's correct responses among themselves.
      ``"length"`` (default) is ``r_l`` above, computed here from token counts; any other
      SPEC (docs/positive_rewards.md) is scored where the rewards run and reaches the loss
      as each response's ``ResponseScalars.preference``.
    - ``keep_all_wrong``, ``all_correct_length_signal``, ``lambda_by_pass_rate`` and its
      ``pass_rate_prior``: options of ``drpo_objective``, off in the released runs.
    - ``rollout_correction``: importance weights pi_old/mu for the engines' samples, from
      OpenRLHF's ``--algo.advantage.is_correction_*`` flags (``rollout_correction``); off
      in the released runs.
    """

    lam: float = 0.1
    tau: float = 10.0
    delta: float = 1e-4
    beta0: float = 1e3
    penalty_form: str = "authors"
    kl_estimate: str = "minibatch"
    length_reward: str = "linear"
    max_len: int | None = None
    positive_reward: str = LENGTH_POSITIVE_REWARD
    keep_all_wrong: bool = False
    all_correct_length_signal: bool = False
    lambda_by_pass_rate: bool = False
    pass_rate_prior: float = 0.0
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)

    def __post_init__(self) -> None:
        if not self.lam > 0:
            raise ValueError(f"lam (lambda) must be > 0 or inf, got {self.lam}")
        if not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"tau must be a positive finite number, got {self.tau}")
        if not self.delta >= 0:
            raise ValueError(f"delta must be >= 0, got {self.delta}")
        if not self.beta0 >= 0:
            raise ValueError(f"beta0 must be >= 0, got {self.beta0}")
        if self.penalty_form not in PENALTY_FORMS:
            raise ValueError(f"penalty_form must be one of {PENALTY_FORMS}")
        if self.kl_estimate not in KL_ESTIMATES:
            raise ValueError(f"kl_estimate must be one of {KL_ESTIMATES}")
        if self.length_reward not in LENGTH_REWARDS:
            raise ValueError(f"length_reward must be one of {LENGTH_REWARDS}")
        if self.max_len is not None and self.max_len <= 0:
            raise ValueError(f"max_len (C) must be positive, got {self.max_len}")
        if not isinstance(self.positive_reward, str) or not self.positive_reward.strip():
            raise ValueError("positive_reward must name a reward ('length' by default)")
        if self.lambda_by_pass_rate and math.isinf(self.lam):
            raise ValueError("lambda_by_pass_rate needs a finite lam")
        if not (self.pass_rate_prior >= 0 and math.isfinite(self.pass_rate_prior)):
            raise ValueError(f"pass_rate_prior must be >= 0 and finite, got {self.pass_rate_prior}")
        if self.pass_rate_prior and not self.lambda_by_pass_rate:
            raise ValueError("pass_rate_prior shrinks lambda_by_pass_rate's rate: turn that on")
        if not isinstance(self.rollout_correction, RolloutCorrection):
            raise ValueError("rollout_correction must be a RolloutCorrection")

    @property
    def length_positive_reward(self) -> bool:
        """The correct responses are ranked by ``r_l`` of their token counts (today's DRPO)."""
        return is_length_positive_reward(self.positive_reward)

    @property
    def length_c(self) -> int:
        """``C`` of the length reward, as the run's options resolved it; unresolved, the loss
        would have to guess the run's budget, so it is refused."""
        if self.max_len is None:
            raise ValueError(
                "DRPOConfig.max_len (the length reward's C) is unset: a run's options resolve "
                "it from --drpo.max_len, --rollout.max_new_tokens or --data.max_len; give it"
            )
        return self.max_len

    @property
    def effective_beta0(self) -> float:
        """The ``beta0`` to put in the paper's penalty so that its gradient is the chosen one."""
        return self.beta0 if self.penalty_form == "paper" else self.beta0 / 2

    def objective_options(self) -> ObjectiveOptions:
        return ObjectiveOptions(
            keep_all_wrong=self.keep_all_wrong,
            all_correct_length_signal=self.all_correct_length_signal,
            lambda_by_pass_rate=self.lambda_by_pass_rate,
            pass_rate_prior=self.pass_rate_prior,
        )
