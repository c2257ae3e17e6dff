"""Group-relative advantages of the GRPO-style baselines (paper Eq. (advan), Appendix).

The baselines turn one prompt's shaped rewards into advantages by comparing each response with
the rest of its group. Both estimators are pure functions of one group's rewards so that the
misleading-signal analysis (``learning_signal``) and the trainer share the same arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

ESTIMATORS = ("grpo", "rloo")


def _finite_floats(values: Iterable[float], what: str) -> list[float]:
    """Plain floats from a list, numpy array or torch tensor, rejecting NaN and inf."""
    out = [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"{what} must be finite, got {out}")
    return out


def has_relative_signal(rewards: Iterable[float]) -> bool:
    """Whether one prompt's rewards give any response a non-zero advantage under either
    estimator: they are not all equal (a lone response has no other to compare with)."""
    r = _finite_floats(rewards, "rewards")
    return bool(r) and max(r) != min(r)


def group_advantages(rewards: Iterable[float], estimator: str) -> list[float]:
    """Advantages of one prompt's group of responses.

    ``grpo``: ``(r - mean) / std`` with the population std (the paper's Eq. (advan); its
    Appendix table is reproduced with it). A group whose rewards are all equal has no
    relative signal and gets all zeros instead of ``0 / 0``.
    ``rloo``: ``r_i - mean of the other rewards``; a single response has no others and gets 0.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")
    r = _finite_floats(rewards, "rewards")
    n = len(r)
    if n == 0:
        raise ValueError("a group needs at least one reward")
    # Equal rewards give std = 0 exactly in exact arithmetic; testing for them first avoids
    # dividing rounding noise (e.g. mean(0.1, 0.1, 0.1) != 0.1) by a tiny std.
    if not has_relative_signal(r):
        return [0.0] * n
    total = math.fsum(r)
    if estimator == "rloo":
        return [(n * x - total) / (n - 1) for x in r]
    # Scaled by the largest deviation so that tiny or huge spreads neither under- nor overflow.
    dev = [x - total / n for x in r]
    scale = max(abs(d) for d in dev)
    unit = [d / scale for d in dev]
    rms = math.sqrt(math.fsum(u * u for u in unit) / n)
    return [u / rms for u in unit]
