"""How many weight versions a rollout's responses are behind the weights that train on them.

A weight version counts the trainer's updates: 0 is the weights the run started from, ``v`` the
weights after update ``v`` (a resumed run goes on counting from its checkpoint's step). Each
vLLM engine is told the version it was last sent, and each prompt's responses carry the
version their engine held when they were requested (``first``) and when they came back
(``last``). Every token of them was sampled by a version in ``[first, last]``: with generation
and weight syncs never overlapping (synchronous training, asynchronous training without
partial rollout) the two are equal; under partial rollout a sync may pause a response and
resume it on newer weights, so it spans versions (one end may be one version wider than the
tokens themselves, when a sync lands between a request and its first token or its last token
and its return: the interval never misses a version).

The trainer scores the rollout (pi_old) with version ``trained``, so a response's lag is
``trained - first`` for its oldest token and ``trained - last`` for its newest. Only responses
sampled wholly by version ``trained`` (``fresh``) can have their vLLM log-probs compared with
the actor's as a check of the weights; the others' gap includes the policy's own change.

No OpenRLHF, vLLM or Ray import: the driver's trainer and the tests share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Versions = tuple[int, int]  # the versions a response's tokens came from: (first, last)


def check_versions(versions: Sequence[Versions], trained: int) -> None:
    """Raise ``ValueError`` unless every ``(first, last)`` has ``first <= last <= trained``: an
    engine cannot have been sent weights newer than those the trainer holds before its update,
    nor a response end on older weights than it started on."""
    for first, last in versions:
        if not first <= last <= trained:
            raise ValueError(
                f"a response tagged with weight versions {first}..{last} while the trainer "
                f"holds version {trained}: the weight-version bookkeeping is broken"
            )


def fresh_rows(versions: Sequence[Versions], trained: int) -> list[bool]:
    """Which responses were sampled wholly by version ``trained``."""
    return [first == last == trained for first, last in versions]


@dataclass(frozen=True)
class PolicyLag:
    """A rollout's lag behind version ``trained``: the largest (``oldest``: of any token) and
    smallest (``newest``: of the newest token of any response) and the mean over responses
    of their oldest token's; the share of responses that span versions (``mixed``) and of
    those with any token older than ``trained`` (``stale``)."""

    trained: int
    oldest: int
    newest: int
    mean: float
    mixed: float
    stale: float

    def metrics(self) -> dict[str, float]:
        return {
            "drpo/policy_lag_max": float(self.oldest),
            "drpo/policy_lag_min": float(self.newest),
            "drpo/policy_lag_mean": self.mean,
            "drpo/mixed_version_fraction": self.mixed,
            "drpo/stale_response_fraction": self.stale,
        }

    def describe(self) -> str:
        """For the step line: ``policy lag 1``, or ``policy lag 0-2 (25% span versions)``."""
        lag = str(self.oldest) if self.oldest == self.newest else f"{self.newest}-{self.oldest}"
        if not self.mixed:
            return f"policy lag {lag}"
        return f"policy lag {lag} ({100 * self.mixed:.0f}% span versions)"


def policy_lag(versions: Sequence[Versions], trained: int) -> PolicyLag:
    """The ``PolicyLag`` of a rollout's responses' ``(first, last)`` versions."""
    if not versions:
        raise ValueError("a rollout without responses has no policy lag")
    check_versions(versions, trained)
    count = len(versions)
    return PolicyLag(
        trained=trained,
        oldest=max(trained - first for first, _ in versions),
        newest=min(trained - last for _, last in versions),
        mean=sum(trained - first for first, _ in versions) / count,
        mixed=sum(first < last for first, last in versions) / count,
        stale=sum(first < trained for first, _ in versions) / count,
    )
