"""Rollout correction: DRPO's expectations over pi_old, estimated from the engines' samples.

The objective's expectations are over pi_old's correct and incorrect responses of a prompt,
but the vLLM engines sample from their own distribution ``mu`` (other kernels and rounding;
with asynchronous training also older weights). The trainer recomputes pi_old's log-probs,
so the ratio ``rho(o) = pi_old(o) / mu(o)`` covers both. With ``rho`` as a sequence weight
(``pi_old+ / mu+ = rho / E_mu+[rho]``), self-normalised within the group::

    sum_{S+} w s    with  w = softmax_{S+}(r/lambda + log rho)
    tau log mean_{S-} exp(s/tau)  ->  tau [lse_{S-}(s/tau + log rho) - lse_{S-}(log rho)]

(the normaliser ``E_mu+[rho]`` cancels in the positives' ratio; the negatives' mean becomes
a weighted mean). ``rho = 1`` gives the uncorrected objective exactly.

Weights never reach pi_old's samples' *values*: a score stays the mean token log-prob that
the softmax and log-sum-exp read. What a variant weights (``rollout_weights``):

- ``seq`` + ``clip``: the truncated sequence weight ``clamp(rho, low, high)`` as above.
- ``token`` + ``clip`` / ``mask`` (TIS / ICEPOP): each token's ratio ``pi_old/mu``, clamped
  into ``[low, high]`` or zero outside it, multiplies that token's term in the score's
  gradient and in the trust region's KL; the group's sums are unweighted (each token's
  conditional is corrected, its prefix's distribution is left as mu's: bias for variance).
- ``seq`` + ``mask``: a response whose statistic (geometric-mean ratio, or the mean binary
  KL / TV of its tokens) lies outside the band leaves the objective and the KL, as if never
  sampled; survivors' tokens keep their ratio, as in ``token`` + ``mask``.

The KL ``sum w (log pi_old - log pi_theta) / sum w``, weighted by the same weights (the
sequence weight, or the tokens'), estimates ``KL(pi_old || pi_theta)`` on pi_old's tokens;
unweighted on mu's samples it is ``KL(mu||pi_theta) - KL(mu||pi_old)``, whose gradient pulls
the policy towards mu once the hinge fires. docs/algorithm.md, "Rollout correction", derives
all of it; docs/rollout-correction.md says when each variant is the right one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from drpo_openrlhf.algo.groups import dense_group_index, segment_sum

LEVELS = ("off", "token", "seq")
MODES = ("mask", "clip")
GATINGS = ("ratio", "binary_kl", "tv")
# OpenRLHF's flags, in ``rollout_correction``'s argument order
CORRECTION_FLAGS = tuple(
    f"algo.advantage.is_correction_{name}" for name in ("level", "mode", "gating", "threshold")
)
DEFAULT_BAND = (0.5, 5.0)  # OpenRLHF's default --algo.advantage.is_correction_threshold
PROB_CLAMP = 1e-6  # keeps the binary KL's logs finite (OpenRLHF's clamp)


def refusal(level: str, mode: str, gating: str, low: float, high: float) -> str | None:
    """Why DRPO refuses this combination of OpenRLHF's correction flags, or ``None``."""
    if level not in LEVELS or mode not in MODES or gating not in GATINGS:
        return f"level, mode and gating must be in {LEVELS}, {MODES} and {GATINGS}"
    if level == "off":
        given = {"mode": mode != "mask", "gating": gating != "ratio"}
        given["threshold"] = (low, high) != DEFAULT_BAND
        changed = [f"--algo.advantage.is_correction_{name}" for name, on in given.items() if on]
        if changed:
            return (
                f"{' and '.join(changed)} do nothing without "
                "--algo.advantage.is_correction_level token or seq"
            )
        return None
    if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= high):
        return f"the threshold must be finite with 0 <= LOW <= HIGH, got {low} {high}"
    if gating != "ratio":
        if mode == "clip":
            return (
                f"--algo.advantage.is_correction_gating {gating} is a divergence, a filter and "
                "not a weight: it takes --algo.advantage.is_correction_mode mask"
            )
        if low > 0:
            return (
                f"--algo.advantage.is_correction_gating {gating} bounds a divergence from above "
                "only: give one threshold, HIGH"
            )
        return None
    if not low <= 1 <= high:
        return (
            f"the ratio band [{low}, {high}] leaves out 1, the ratio of engines that match the "
            "trainer exactly: it would drop or clamp every token of a run without mismatch"
        )
    return None


@dataclass(frozen=True)
class RolloutCorrection:
    """DRPO's reading of OpenRLHF's ``--algo.advantage.is_correction_*`` flags (off: the
    released runs); ``low``/``high`` bound the ratio (or, ``seq`` + ``clip``, the sequence
    weight) or, under a divergence gating, the divergence from above."""

    level: str = "off"
    mode: str = "mask"
    gating: str = "ratio"
    low: float = DEFAULT_BAND[0]
    high: float = DEFAULT_BAND[1]

    def __post_init__(self) -> None:
        why = refusal(self.level, self.mode, self.gating, self.low, self.high)
        if why:
            raise ValueError(f"rollout correction: {why}")

    @property
    def enabled(self) -> bool:
        return self.level != "off"


def rollout_correction(
    level: str, mode: str, gating: str, threshold: list[float] | tuple[float, ...]
) -> RolloutCorrection:
    """The correction of OpenRLHF's four flags (a single threshold is ``0 HIGH``, as OpenRLHF
    reads it). Raises ``ValueError`` saying why DRPO refuses the combination."""
    band = [float(t) for t in threshold]
    if len(band) == 1:
        band.insert(0, 0.0)
    if len(band) != 2:
        raise ValueError(
            f"rollout correction: --algo.advantage.is_correction_threshold takes HIGH or LOW "
            f"HIGH, got {list(threshold)}"
        )
    return RolloutCorrection(level, mode, gating, band[0], band[1])


@dataclass(frozen=True)
class CorrectionScalars:
    """Per-response summaries of the correction (1-D, float64), gathered like the scores.

    ``log_weight``: the response's log weight in its group's sums (``seq`` + ``clip``; else
    0); ``keep``: it stays in the objective (``seq`` + ``mask``); ``kl_tokens``: ``sum_t w_t``,
    its KL sum's denominator. For the metrics: ``engine_kl``/``engine_kl_k3``: sums over its
    tokens of ``log mu - log pi_old`` and of ``r - 1 - log r`` (``r = pi_old/mu``);
    ``units``: tokens (token level) or 1, ``corrected``: how many of them were masked or
    clipped; ``unit_weight``/``unit_weight_sq``: the sum of their weights and of the squares.
    """

    log_weight: Tensor
    keep: Tensor
    kl_tokens: Tensor
    engine_kl: Tensor
    engine_kl_k3: Tensor
    units: Tensor
    corrected: Tensor
    unit_weight: Tensor
    unit_weight_sq: Tensor

    def __len__(self) -> int:
        return self.log_weight.numel()

    def columns(self) -> list[Tensor]:
        """The fields as float64 rows, in field order (``from_columns`` reads them back)."""
        return [getattr(self, f.name).double() for f in fields(self)]

    @staticmethod
    def from_columns(rows: list[Tensor] | tuple[Tensor, ...]) -> CorrectionScalars:
        values = dict(zip([f.name for f in fields(CorrectionScalars)], rows, strict=True))
        return CorrectionScalars(**{**values, "keep": values["keep"].bool()})

    @staticmethod
    def concat(parts: list[CorrectionScalars]) -> CorrectionScalars:
        columns = zip(*(p.columns() for p in parts), strict=True)
        return CorrectionScalars.from_columns([torch.cat(c) for c in columns])


class RolloutWeights(NamedTuple):
    """What a micro-batch's forward needs: ``(B, T)`` token weights (0 off the mask) and the
    responses' summaries."""

    tokens: Tensor
    scalars: CorrectionScalars


def _divergence(old_log_probs: Tensor, rollout_log_probs: Tensor, gating: str) -> Tensor:
    """Per token: the binary KL or the TV distance between the engine's and pi_old's
    probability of the sampled token (OpenRLHF's statistics)."""
    p = rollout_log_probs.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    q = old_log_probs.exp().clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    if gating == "binary_kl":
        return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    return (p - q).abs()


@torch.no_grad()
def rollout_weights(
    correction: RolloutCorrection,
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
) -> RolloutWeights:
    """Token weights and per-response summaries from pi_old's and the engines' ``(B, T)``
    log-probs of the sampled tokens (float64; at ``mu = pi_old`` every weight is exactly 1).

    Token weights multiply each token's term in the score's gradient and in the KL sum
    (``minibatch.response_scalars``); the sequence weight and the keep flag act on the
    group's sums (``objective.drpo_objective``)."""
    if not correction.enabled:
        raise ValueError("rollout_weights needs a correction that is on")
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != mask.shape:
        raise ValueError(
            f"pi_old's log-probs {tuple(old_log_probs.shape)}, the engines' "
            f"{tuple(rollout_log_probs.shape)} and the mask {tuple(mask.shape)} differ in shape"
        )
    on = mask.bool()
    old, rollout = old_log_probs.double(), rollout_log_probs.double()
    if not (torch.isfinite(rollout[on]).all() and torch.isfinite(old[on]).all()):
        raise ValueError(
            "a response token's log-prob is not finite (the engines' or pi_old's): the rollout "
            "correction cannot weight it"
        )
    log_ratio = torch.where(on, old - rollout, 0.0)  # log pi_old/mu, 0 off the mask
    ratio = log_ratio.exp()
    num_tokens = on.sum(-1).double()
    low, high = correction.low, correction.high
    ones = torch.ones_like(num_tokens)
    log_weight = torch.zeros_like(num_tokens)
    keep = torch.ones_like(num_tokens, dtype=torch.bool)
    if correction.level == "token":
        if correction.mode == "clip":
            tokens = ratio.clamp(low, high)
            corrected = (ratio < low) | (ratio > high)
        else:
            stat = (
                ratio
                if correction.gating == "ratio"
                else _divergence(old, rollout, correction.gating)
            )
            inside = (stat >= low) & (stat <= high)
            tokens, corrected = torch.where(inside, ratio, 0.0), ~inside
        tokens = torch.where(on, tokens, 0.0)
        corrected = (corrected & on).sum(-1).double()
        units, unit_weight, unit_weight_sq = num_tokens, tokens.sum(-1), tokens.square().sum(-1)
    elif correction.mode == "clip":  # the truncated sequence weight
        log_rho = log_ratio.sum(-1)
        lo = math.log(low) if low > 0 else -math.inf
        log_weight = log_rho.clamp(lo, math.log(high))
        corrected = (log_weight != log_rho).double()
        tokens = on.double()
        v = log_weight.exp()
        units, unit_weight, unit_weight_sq = ones, v, v.square()
    else:  # sequences masked on a per-sequence statistic; survivors keep their tokens' ratios
        if correction.gating == "ratio":
            stat = (log_ratio.sum(-1) / num_tokens.clamp(min=1)).exp()  # geometric mean
        else:
            divergence = torch.where(on, _divergence(old, rollout, correction.gating), 0.0)
            stat = divergence.sum(-1) / num_tokens.clamp(min=1)
        keep = (stat >= low) & (stat <= high)
        tokens = torch.where(on & keep[:, None], ratio, 0.0)
        corrected = (~keep).double()
        units, unit_weight, unit_weight_sq = ones, keep.double(), keep.double()
    k3 = torch.where(on, ratio - 1 - log_ratio, 0.0).sum(-1)
    scalars = CorrectionScalars(
        log_weight=log_weight,
        keep=keep,
        kl_tokens=tokens.sum(-1),
        engine_kl=-log_ratio.sum(-1),
        engine_kl_k3=k3,
        units=units,
        corrected=corrected,
        unit_weight=unit_weight,
        unit_weight_sq=unit_weight_sq,
    )
    return RolloutWeights(tokens, scalars)


def group_normalised(
    log_weights: Tensor, members: Tensor, index: Tensor, num_groups: int
) -> Tensor:
    """``v / sum_group v`` over each group's ``members`` (0 elsewhere), ``v = exp(log_weights)``
    shifted by the group's largest: exactly ``1/count`` when every log weight is 0."""
    masked = torch.where(members, log_weights, -math.inf)
    top = log_weights.new_full((num_groups,), -math.inf)
    top = top.scatter_reduce(0, index, masked, "amax", include_self=True)
    e = torch.where(members, torch.exp(torch.where(members, log_weights - top[index], 0.0)), 0.0)
    total = segment_sum(e, index, num_groups).clamp(min=1.0)  # >= 1 where a member exists
    return e / total[index]


def kl_parts(kl_sum: Tensor, c: CorrectionScalars) -> tuple[Tensor, Tensor]:
    """Each response's share of the weighted KL's numerator and denominator: its sequence
    weight times its (token-weighted) KL sum and token weight."""
    v = c.log_weight.exp().to(kl_sum.dtype)
    return v * kl_sum, v * c.kl_tokens.to(kl_sum.dtype)


def correction_metrics(
    c: CorrectionScalars, group_ids: Tensor, num_tokens: Tensor
) -> dict[str, Tensor]:
    """What the peers log: the engines' token-mean KL to pi_old (``is_kl``: the log-ratio,
    OpenRLHF's ``vllm_kl``; ``is_kl_k3``), the share of units masked or clipped
    (``is_filtered``, OpenRLHF's ``is_filter_ratio``) and the weights' effective sample size
    per group as a share of its units (``is_ess``: the mean over groups, ``is_ess_min``)."""
    tokens = num_tokens.double().sum().clamp(min=1.0)
    index, num_groups = dense_group_index(group_ids)
    total = segment_sum(c.unit_weight, index, num_groups)
    squares = segment_sum(c.unit_weight_sq, index, num_groups)
    units = segment_sum(c.units, index, num_groups)
    ess = torch.where(squares > 0, total.square() / (units * squares).clamp(min=1e-300), 0.0)
    return {
        "is_kl": c.engine_kl.sum() / tokens,
        "is_kl_k3": c.engine_kl_k3.sum() / tokens,
        "is_filtered": c.corrected.sum() / c.units.sum().clamp(min=1.0),
        "is_ess": ess.mean(),
        "is_ess_min": ess.min(),
    }
