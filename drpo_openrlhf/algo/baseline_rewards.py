"""Length-shaped rewards of the paper's six baselines (Appendix table ``tab:reward``).

Each baseline folds a length term into the reward of one prompt's group of responses; the
group advantage (``advantages.group_advantages``) is then taken over these rewards. The
formulas, defaults and every deviation from the baselines' own code are documented, with their
sources, in ``docs/baselines.md``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

METHODS = ("rloo_lp", "alp", "hapo", "l1_max", "shorter_better", "laser_d")
DIFFICULTY_LEVELS = ("low", "medium", "high")
T = TypeVar("T")

_REQUIRED = object()


@dataclass(frozen=True)
class _Param:
    valid: Callable[[float], bool]
    doc: str  # what a valid value is, for error messages
    default: object = _REQUIRED
    nullable: bool = False


_NON_NEGATIVE = (lambda v: v >= 0, "a finite number >= 0")
_POSITIVE = (lambda v: v > 0, "a finite number > 0")
_UNIT = (lambda v: 0 <= v <= 1, "a number in [0, 1]")
_FINITE = (lambda v: True, "a finite number")

_SPECS: dict[str, dict[str, _Param]] = {
    # Arora & Zanette sweep alpha (no single default); alpha <= 1 keeps correct >= incorrect.
    "rloo_lp": {"alpha": _Param(*_UNIT)},
    # ALP: K is the number of rollouts per prompt, so by default the group size.
    "alp": {
        "beta": _Param(*_NON_NEGATIVE),
        "K": _Param(
            lambda v: v >= 1 and float(v).is_integer(), "an integer >= 1", None, nullable=True
        ),
    },
    # HAPO code defaults: w_lr = 1 (README: must lie in [0, 1]), cutoff -0.7. h is per prompt.
    "hapo": {
        "w": _Param(*_UNIT, 1.0),
        "c": _Param(lambda v: -1 <= v <= 0, "a number in [-1, 0]", -0.7),
        "h": _Param(*_POSITIVE, nullable=True),
    },
    # L1 (LCPO-Max): alpha = 0.0003, delta = 0.5; the target is the prompt's requested budget.
    "l1_max": {
        "alpha": _Param(*_NON_NEGATIVE, 0.0003),
        "target_length": _Param(*_POSITIVE),
        "delta": _Param(*_FINITE, 0.5),
    },
    # ShorterBetter: beta = 0.001; alpha is swept (1 and 2 in its paper).
    "shorter_better": {"alpha": _Param(*_NON_NEGATIVE), "beta": _Param(*_NON_NEGATIVE, 0.001)},
    # LASER-D: length_reward_scalar = 0.5 in its scripts; the target comes per group.
    "laser_d": {"alpha": _Param(*_NON_NEGATIVE, 0.5), "target_length": _Param(*_POSITIVE)},
}


def resolve_hparams(
    method: str, hparams: Mapping[str, object], per_group: Iterable[str] = ()
) -> dict[str, object]:
    """Validated hyper-parameters of ``method`` with the published defaults filled in.

    Names in ``per_group`` are supplied later for each group (HAPO's ``h``, a LASER-D target
    chosen by difficulty): they must not be given here and are left out of the result.
    Raises ``ValueError`` for an unknown method or name, a missing value or an invalid one.
    """
    if method not in _SPECS:
        raise ValueError(f"unknown shaping method {method!r}; choose one of {METHODS}")
    specs = _SPECS[method]
    per_group = set(per_group)
    unknown = sorted(set(hparams) - set(specs))
    if unknown:
        raise ValueError(f"{method} takes hyper-parameters {sorted(specs)}, not {unknown}")
    clash = sorted(per_group & set(hparams))
    if clash:
        raise ValueError(f"{method}: {clash} are set per group and cannot be fixed here")
    resolved: dict[str, object] = {}
    for name, spec in specs.items():
        if name in per_group:
            continue
        value = hparams.get(name, spec.default)
        if value is _REQUIRED:
            raise ValueError(f"{method} needs {name} ({spec.doc})")
        if value is None and spec.nullable:
            resolved[name] = None
            continue
        number = _real(value)
        if number is None or not math.isfinite(number) or not spec.valid(number):
            raise ValueError(f"{method}: {name} must be {spec.doc}, got {value!r}")
        resolved[name] = number
    return resolved


def _real(value: object) -> float | None:
    """``value`` as a float if it is a real number (numpy's included) but not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _as_list(values: Iterable[T]) -> list[T]:
    """A plain list from a list, generator, numpy array or torch tensor."""
    return list(values.tolist() if hasattr(values, "tolist") else values)


def _flags(correct: Iterable[object]) -> list[bool]:
    """Correctness flags of a non-empty group (0/1 or bool), validated."""
    flags = _as_list(correct)
    if not flags:
        raise ValueError("a group needs at least one response")
    if not all(f in (0, 1) for f in flags):
        raise ValueError(f"correctness must be 0/1 or bool, got {flags}")
    return [bool(f) for f in flags]


def _group(lengths: Iterable[float], correct: Iterable[object]) -> tuple[list[float], list[bool]]:
    """One group's lengths (finite, >= 0) and correctness flags, validated."""
    lens = [float(v) for v in _as_list(lengths)]
    flags = _flags(correct)
    if len(lens) != len(flags):
        raise ValueError(f"{len(lens)} lengths but {len(flags)} correctness flags")
    if not all(math.isfinite(v) and v >= 0 for v in lens):
        raise ValueError(f"lengths must be finite and >= 0, got {lens}")
    return lens, flags


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std; exactly 0 std when all values are equal."""
    mean = math.fsum(values) / len(values)
    if max(values) == min(values):
        return mean, 0.0
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def _rloo_lp(lengths: list[float], correct: list[bool], alpha: float) -> list[float]:
    """``r_c (1 - alpha sigmoid(z))``, ``z`` = length z-scored over the correct responses."""
    positives = [n for n, ok in zip(lengths, correct, strict=True) if ok]
    if not positives:
        return [0.0] * len(lengths)
    mean, std = _mean_std(positives)
    # One correct response, or equal correct lengths: nothing to rank, z = 0 (sigmoid 1/2).
    # Population z-scores of the correct lengths lie in [-sqrt(n-1), sqrt(n-1)]: exp is safe.
    return [
        1.0 - alpha / (1.0 + math.exp(-(n - mean) / std if std > 0 else 0.0)) if ok else 0.0
        for n, ok in zip(lengths, correct, strict=True)
    ]


def _alp(lengths: list[float], correct: list[bool], beta: float, K: float | None) -> list[float]:
    """``r_c - beta |o| max(solve rate, 1/K)``, applied to every response."""
    k = len(lengths) if K is None else K
    scale = beta * max(sum(correct) / len(correct), 1.0 / k)
    return [float(ok) - scale * n for n, ok in zip(lengths, correct, strict=True)]


def _hapo(
    lengths: list[float], correct: list[bool], w: float, c: float, h: float | None
) -> list[float]:
    """HAPO: cosine of ``|o| / h`` clipped at ``c`` when correct, at 0 from above when not."""
    if h is None:  # no correct response in this prompt's history yet: no length term
        return [float(ok) for ok in correct]
    out = []
    for n, ok in zip(lengths, correct, strict=True):
        x = math.cos(min(math.pi / 2 * n / h, math.pi))
        out.append(1.0 + w * max(x, c) if ok else w * min(x, 0.0))
    return out


def _l1_max(
    lengths: list[float], correct: list[bool], alpha: float, target_length: float, delta: float
) -> list[float]:
    """LCPO-Max: ``r_c clip(alpha (L_T - |o|) + delta, 0, 1)``."""
    return [
        min(max(alpha * (target_length - n) + delta, 0.0), 1.0) if ok else 0.0
        for n, ok in zip(lengths, correct, strict=True)
    ]


def _shorter_better(
    lengths: list[float], correct: list[bool], alpha: float, beta: float
) -> list[float]:
    """``alpha r_c - beta |(|o| - L_SOL)|`` with the sample-optimal length ``L_SOL``."""
    positives = [n for n, ok in zip(lengths, correct, strict=True) if ok]
    sol = min(positives) if positives else math.fsum(lengths) / len(lengths)
    return [alpha * ok - beta * abs(n - sol) for n, ok in zip(lengths, correct, strict=True)]


def _laser_d(
    lengths: list[float], correct: list[bool], alpha: float, target_length: float
) -> list[float]:
    """Step reward: ``r_c (1 + alpha 1[|o| <= L_A])``."""
    return [
        (1.0 + alpha * (n <= target_length)) if ok else 0.0
        for n, ok in zip(lengths, correct, strict=True)
    ]


_SHAPERS: dict[str, Callable[..., list[float]]] = {
    "rloo_lp": _rloo_lp,
    "alp": _alp,
    "hapo": _hapo,
    "l1_max": _l1_max,
    "shorter_better": _shorter_better,
    "laser_d": _laser_d,
}


def shape_rewards(
    method: str, lengths: Iterable[float], correct: Iterable[object], **hparams: object
) -> list[float]:
    """Shaped rewards of ONE prompt's group (``lengths`` in tokens, ``correct`` 0/1).

    Methods and hyper-parameters (defaults in brackets, see ``docs/baselines.md``):
    ``rloo_lp`` (alpha), ``alp`` (beta, K [group size]), ``hapo`` (w [1], c [-0.7], h: the
    prompt's shortest correct length seen before, None for none), ``l1_max`` (alpha [0.0003],
    target_length, delta [0.5]), ``shorter_better`` (alpha, beta [0.001]), ``laser_d``
    (alpha [0.5], target_length; see ``laser_d_target_length`` for the adaptive choice).
    """
    resolved = resolve_hparams(method, hparams)
    lens, flags = _group(lengths, correct)
    return _SHAPERS[method](lens, flags, **resolved)


def laser_d_difficulty(correct: Iterable[object]) -> str:
    """LASER-D's difficulty level of a group from its accuracy ``k/n``.

    ``high`` for accuracy >= 2/3, ``medium`` for >= 1/3, else ``low`` (the rule its training
    reward applies), compared in integers so that exact thirds fall in the higher level.
    """
    flags = _flags(correct)
    n, k = len(flags), sum(flags)
    if 3 * k >= 2 * n:
        return "high"
    return "medium" if 3 * k >= n else "low"


def check_bucket_targets(bucket_targets: object) -> Mapping[str, float]:
    """``bucket_targets`` itself, checked: raises ``ValueError`` unless it maps each difficulty
    level to a length > 0 (a value read from a checkpoint or a flag may be anything)."""
    if not isinstance(bucket_targets, Mapping) or set(bucket_targets) != set(DIFFICULTY_LEVELS):
        raise ValueError(f"bucket targets need exactly {DIFFICULTY_LEVELS}, got {bucket_targets}")
    for level, target in bucket_targets.items():
        number = _real(target)
        if number is None or not number > 0:
            raise ValueError(f"bucket target for {level} must be a number > 0, got {target!r}")
    return bucket_targets


def laser_d_target_length(correct: Iterable[object], bucket_targets: Mapping[str, float]) -> float:
    """The target ``L_A`` LASER-D uses for a group: its difficulty level's target length."""
    check_bucket_targets(bucket_targets)
    return float(bucket_targets[laser_d_difficulty(correct)])


def laser_d_bucket_targets(
    groups: Iterable[tuple[Sequence[float], Sequence[object]]],
    thresholds: Sequence[float],
    max_length: float,
    expected_n_correct: int = 1,
) -> dict[str, float]:
    """Per-difficulty target lengths from monitoring rollouts (LASER-D's dynamic update).

    ``groups`` are (lengths, correct) of prompts of a monitoring set, all with the same number
    ``n`` of samples. For each level, the coverage ``P(L)`` is the fraction of that level's
    responses (correct or not) no longer than ``L``; its expected number of correct responses
    within ``L`` is ``floor(P(L) * C)`` with ``C`` the fewest correct responses a group of the
    level has (``floor(2n/3)``, ``floor(n/3)``, 1 for high, medium, low). The target is the
    smallest threshold whose expectation reaches ``expected_n_correct``, else ``max_length``.
    """
    pooled: dict[str, list[float]] = {level: [] for level in DIFFICULTY_LEVELS}
    sizes = set()
    for lengths, correct in groups:
        lens, flags = _group(lengths, correct)
        sizes.add(len(lens))
        pooled[laser_d_difficulty(flags)].extend(lens)
    if len(sizes) > 1:
        raise ValueError(f"monitoring groups must all have the same size, got sizes {sizes}")
    if not max_length > 0 or expected_n_correct < 1:
        raise ValueError("max_length must be > 0 and expected_n_correct >= 1")
    n = sizes.pop() if sizes else 0
    fewest_correct = {"high": 2 * n // 3, "medium": n // 3, "low": 1}
    targets = {}
    for level, lens in pooled.items():
        targets[level] = float(max_length)
        for t in sorted(thresholds):
            covered = sum(v <= t for v in lens)
            # floor(covered / total * C) >= e  <=>  covered * C >= e * total (exact in ints)
            if (
                lens
                and t < max_length
                and covered * fewest_correct[level] >= (expected_n_correct * len(lens))
            ):
                targets[level] = float(t)
                break
    return targets
