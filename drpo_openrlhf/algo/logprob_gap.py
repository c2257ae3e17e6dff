"""How far the rollout engine's token log-probs are from the trainer's on the same weights.

After a weight sync vLLM and the actor hold the same policy, so the log-probs vLLM reported
while sampling should equal the actor's own up to numerical precision. A large gap means the
sync did not happen (an engine still sampling from old or uninitialised weights) or a
precision mismatch, both of which bias every update silently. How large the honest gap is
depends on the hardware, kernels and precision (CPU: 0.001-0.003 nats per token), so the
limit is derived from a rollout whose weights are known to be exact (``GapLimit``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def logprob_gap(
    rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor, action_mask: torch.Tensor
) -> tuple[float, float, int]:
    """``(mean, max, count)`` of ``|rollout - actor|`` over the action tokens of a batch
    (``(B, A)`` tensors). ``count`` lets batches be pooled; an empty mask gives ``(0, 0, 0)``."""
    if rollout_log_probs.shape != actor_log_probs.shape:
        raise ValueError(
            f"rollout log-probs {tuple(rollout_log_probs.shape)} and actor log-probs "
            f"{tuple(actor_log_probs.shape)} differ in shape"
        )
    mask = action_mask.bool()
    gap = (rollout_log_probs.double() - actor_log_probs.double()).abs()[mask]
    if gap.numel() == 0:
        return 0.0, 0.0, 0
    return gap.mean().item(), gap.max().item(), gap.numel()


def pooled_gap(parts: list[tuple[float, float, int]]) -> tuple[float, float]:
    """Mean and max of the gap over several batches' ``logprob_gap`` results."""
    count = sum(n for _, _, n in parts)
    if count == 0:
        return 0.0, 0.0
    return sum(m * n for m, _, n in parts) / count, max(x for _, x, _ in parts)


HONEST_FACTOR = 10.0  # the derived limit: this many times the honest gap...
MIN_LIMIT = 0.005  # ...and at least this (nats), so an exact kernel match does not stop a run
FALLBACK_LIMIT = 0.05  # the CPU-measured limit, when no honest gap can be measured (docs/cpu.md)


def derived_limit(honest: float) -> float:
    """The limit on the mean gap derived from the honest gap measured in the run itself."""
    return max(HONEST_FACTOR * honest, MIN_LIMIT)


@dataclass
class GapLimit:
    """The limit on a rollout's mean log-prob gap. ``fixed`` (``--drpo.max_logprob_gap``) when
    given; otherwise derived from the run's first rollout when its weights were checked exactly
    equal to the actor's (``exact_start``: the check before the first rollout, or of a resumed
    run's first sync), whose gap is then the honest one of this hardware, kernels and
    precision; ``FALLBACK_LIMIT`` when they were not checked."""

    fixed: float | None
    exact_start: bool
    honest: float | None = None

    def limit_for(self, mean: float) -> tuple[float, str | None]:
        """The limit that applies to a rollout whose mean gap is ``mean``, and a line to log
        when this rollout set it."""
        if self.fixed is not None:
            return self.fixed, None
        if not self.exact_start:
            return FALLBACK_LIMIT, None
        if self.honest is not None:
            return derived_limit(self.honest), None
        self.honest = mean
        limit = derived_limit(mean)
        return limit, (
            f"honest rollout log-prob gap {mean:.3g} nats per token (first rollout, engines "
            f"checked to hold the actor's exact weights); limit from now on {limit:.3g} "
            f"(max({HONEST_FACTOR:g} x honest, {MIN_LIMIT:g}); --drpo.max_logprob_gap fixes it)"
        )


def probe_gap(actor: list[float], engine: list[float]) -> tuple[float, float]:
    """Mean and max of ``|engine - actor|`` over the tokens of the weight probe: the same fixed
    sequence scored token by token by a vLLM engine and by the actor."""
    if len(actor) != len(engine) or not actor:
        raise ValueError(f"probe log-probs of {len(actor)} and {len(engine)} tokens")
    gaps = [abs(e - a) for a, e in zip(actor, engine, strict=True)]
    return sum(gaps) / len(gaps), max(gaps)
