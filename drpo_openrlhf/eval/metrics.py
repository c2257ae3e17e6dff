"""Evaluation metrics: pass@k, response-length statistics and the paper's AES."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean

# Metric keys whose dataset-average is the plain mean over datasets (see `average_metrics`).
LENGTH_KEYS = ("mean_length", "mean_length_correct", "mean_length_incorrect")
# Per-response counts beside length (rewards/preference.py): what a positive reward other
# than length (--drpo.positive_reward, docs/positive_rewards.md) targets.
STYLE_KEYS = (
    "mean_reflections",
    "mean_reflections_correct",
    "mean_restated_answers",
    "mean_restated_answers_correct",
)


@dataclass(frozen=True)
class GradedSample:
    """One graded response: what every metric of a dataset is computed from."""

    num_tokens: int
    truncated: bool
    correct: bool
    reason: str
    reflections: int = 0  # reflection phrases (``preference.count_reflections``)
    restated_answers: int = 0  # answer statements beyond the first


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a problem with ``c`` correct among ``n`` samples.

    The probability that at least one of ``k`` samples drawn without replacement from the
    ``n`` is correct, ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021). Exact integer
    binomials keep it exact for the sample counts used here.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def aes(
    acc: float,
    length: float,
    ref_acc: float,
    ref_length: float,
    alpha: float = 1.0,
    beta: float = 3.0,
    gamma: float = 10.0,
) -> float:
    """Accuracy-Efficiency Score of a model against its reference (paper, Section 5).

    ``alpha * dL + beta * |dA|`` when accuracy did not drop, ``alpha * dL - gamma * |dA|``
    when it did, with relative changes ``dL = (ref_length - length) / ref_length`` and
    ``dA = (acc - ref_acc) / ref_acc``. The paper uses alpha=1, beta=3, gamma=10.
    """
    if ref_acc <= 0 or ref_length <= 0:
        raise ValueError(
            f"AES needs a reference with positive accuracy and length, "
            f"got acc={ref_acc}, length={ref_length}"
        )
    delta_length = (ref_length - length) / ref_length
    delta_acc = (acc - ref_acc) / ref_acc
    if delta_acc >= 0:
        return alpha * delta_length + beta * abs(delta_acc)
    return alpha * delta_length - gamma * abs(delta_acc)


def _mean_or_none(values: Sequence[float]) -> float | None:
    return fmean(values) if values else None


def dataset_metrics(problems: Sequence[Sequence[GradedSample]], ks: Sequence[int]) -> dict:
    """Metrics of one dataset from its problems' graded samples.

    ``pass@1`` is the mean correctness over all samples (the paper's definition); every
    other ``pass@k`` is the unbiased estimator averaged over problems. Lengths are response
    tokens (EOS included when the response stopped); a mean over an empty set is None.
    ``mean_reflections`` and ``mean_restated_answers`` (over all and over correct responses)
    count reflection phrases and restated answers per response.
    ``reasons`` counts the grader's reason strings, to see why responses fail.
    """
    samples = [s for problem in problems for s in problem]
    if not samples:
        raise ValueError("a dataset needs at least one sample")
    metrics: dict = {
        "num_problems": len(problems),
        "num_samples": len(samples),
        "pass@1": fmean(s.correct for s in samples),
    }
    for k in sorted(set(ks) - {1}):
        metrics[f"pass@{k}"] = fmean(
            pass_at_k(len(p), sum(s.correct for s in p), k) for p in problems
        )
    metrics["mean_length"] = fmean(s.num_tokens for s in samples)
    metrics["mean_length_correct"] = _mean_or_none([s.num_tokens for s in samples if s.correct])
    metrics["mean_length_incorrect"] = _mean_or_none(
        [s.num_tokens for s in samples if not s.correct]
    )
    for key in ("reflections", "restated_answers"):
        metrics[f"mean_{key}"] = fmean(getattr(s, key) for s in samples)
        metrics[f"mean_{key}_correct"] = _mean_or_none(
            [getattr(s, key) for s in samples if s.correct]
        )
    metrics["truncation_rate"] = fmean(s.truncated for s in samples)
    metrics["reasons"] = dict(sorted(Counter(s.reason for s in samples).items()))
    return metrics


def average_metrics(per_dataset: Mapping[str, Mapping]) -> dict:
    """Unweighted average over datasets, as the paper's "Ave." columns.

    Counts are summed; rates and lengths are means over the datasets where they are defined
    (e.g. a dataset with no incorrect response has no ``mean_length_incorrect``).
    """
    if not per_dataset:
        raise ValueError("nothing to average")
    rows = list(per_dataset.values())
    average: dict = {
        "num_datasets": len(rows),
        "num_problems": sum(r["num_problems"] for r in rows),
        "num_samples": sum(r["num_samples"] for r in rows),
    }
    keys = [k for k in rows[0] if k.startswith("pass@")]
    keys += [*LENGTH_KEYS, *STYLE_KEYS, "truncation_rate"]
    for key in keys:
        average[key] = _mean_or_none([r[key] for r in rows if r.get(key) is not None])
    return average
