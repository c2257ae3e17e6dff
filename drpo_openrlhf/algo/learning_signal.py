"""The paper's misleading-signal diagnostic (Section 2, Appendix ``app:limit``).

A correct response whose learning signal is negative is pushed down by the update: the failure
mode DRPO is built to avoid. The signal is the advantage for GRPO-style methods and
``-d loss / d score`` for DRPO, so one function measures both on equal terms.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def signal_diagnostics(signal: Iterable[float], correct: Iterable[object]) -> dict[str, float]:
    """How the per-response learning ``signal`` treats correct and incorrect responses.

    Returns ``frac_correct_negative`` (fraction of correct responses with signal < 0),
    ``mean_signal_correct``, ``mean_signal_incorrect`` and the counts ``n_correct`` and
    ``n_incorrect`` (so that batches can be pooled by weight). A statistic over an empty set
    is 0.0: with no correct response no correct response is misled, and a missing class adds
    no signal; the counts tell such zeros apart from measured ones.
    """
    values = [float(v) for v in (signal.tolist() if hasattr(signal, "tolist") else signal)]
    flags = list(correct.tolist() if hasattr(correct, "tolist") else correct)
    if len(values) != len(flags):
        raise ValueError(f"{len(values)} signals but {len(flags)} correctness flags")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"learning signals must be finite, got {values}")
    if not all(f in (0, 1) for f in flags):
        raise ValueError(f"correctness must be 0/1 or bool, got {flags}")
    pos = [v for v, ok in zip(values, flags, strict=True) if ok]
    neg = [v for v, ok in zip(values, flags, strict=True) if not ok]
    return {
        "frac_correct_negative": sum(v < 0 for v in pos) / len(pos) if pos else 0.0,
        "mean_signal_correct": math.fsum(pos) / len(pos) if pos else 0.0,
        "mean_signal_incorrect": math.fsum(neg) / len(neg) if neg else 0.0,
        "n_correct": float(len(pos)),
        "n_incorrect": float(len(neg)),
    }
