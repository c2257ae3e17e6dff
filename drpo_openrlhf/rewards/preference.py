"""Text preferences among correct responses: reflection phrases and restated answers.

DRPO's positive reward (``--drpo.positive_reward``, docs/positive_rewards.md) ranks the
correct responses of a prompt among themselves. These are the built-in rankings besides
length, and the per-response counts ``drpo-eval`` reports, so that a run trained on one of
them can be checked on the very quantity it targeted. Plain Python: they run in the vLLM
engines' processes next to the correctness reward.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

# Phrases a reasoning model uses to second-guess itself (overridable: pass ``phrases``).
# Matched case-insensitively as whole words; at one place the longest phrase wins, so
# "let me double-check" counts once, not also as "double-check". "Wait, let me check."
# holds two of them.
REFLECTION_PHRASES: tuple[str, ...] = (
    "wait",
    "hmm",
    "alternatively",
    "on second thought",
    "double-check",
    "double check",
    "let me check",
    "let me recheck",
    "let me re-check",
    "let me verify",
    "let me reconsider",
    "let me re-examine",
    "let's check",
    "let's verify",
)

BOXED = re.compile(r"\\boxed\s*\{")
ANSWER_PHRASE = re.compile(r"\b(?:final answer|the answer is|answer\s*:)", re.IGNORECASE)


@lru_cache(maxsize=32)
def _phrase_pattern(phrases: tuple[str, ...]) -> re.Pattern[str]:
    if not phrases or not all(isinstance(p, str) and p.strip() for p in phrases):
        raise ValueError(f"reflection phrases must be non-empty strings, got {phrases!r}")
    ordered = sorted({p.strip().lower() for p in phrases}, key=len, reverse=True)
    alternatives = "|".join(re.escape(p).replace(r"\ ", r"\s+") for p in ordered)
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)


def count_reflections(text: str, phrases: Iterable[str] = REFLECTION_PHRASES) -> int:
    """How many reflection phrases ``text`` holds (non-overlapping, longest first)."""
    return len(_phrase_pattern(tuple(phrases)).findall(text))


def count_answers(text: str) -> int:
    """How many times ``text`` states a final answer.

    Line by line: each ``\\boxed{`` counts; a line without one counts once if it says
    "the answer is", "final answer" or "answer:". So "The answer is \\boxed{4}" is one
    statement, and a thinking trace that concludes twice before boxing its answer has three.
    """
    total = 0
    for line in text.splitlines():
        boxes = len(BOXED.findall(line))
        total += boxes if boxes else int(bool(ANSWER_PHRASE.search(line)))
    return total


def restated_answers(text: str) -> int:
    """Answer statements beyond the first (0 for a response that states its answer once)."""
    return max(count_answers(text) - 1, 0)


def fewer_reflections(
    texts: Sequence[str],
    lengths: Sequence[int],
    labels: Sequence[str],
    phrases: Iterable[str] = REFLECTION_PHRASES,
) -> list[float]:
    """``1 / (1 + reflections)``: 1 for none, 0.5 for one, ... (in [0, 1] like ``r_l``)."""
    return [1.0 / (1 + count_reflections(t, phrases)) for t in texts]


def fewer_answers(
    texts: Sequence[str], lengths: Sequence[int], labels: Sequence[str]
) -> list[float]:
    """``1 / (1 + restated answers)``: 1 for a response that states its answer once."""
    return [1.0 / (1 + restated_answers(t)) for t in texts]
