"""Math answer grading: R1-style answer extraction + math-verify, with a hard deadline.

``grade_responses`` is the batch API used by the evaluator and the trainer; the OpenRLHF
plugin (``math_reward.reward_func``) is a thin wrapper around it.

Per response, the first of these that applies is its reason:

1. ``bad_label``: the label is missing or empty.
2. ``no_think_end``: the response has no ``</think>`` (e.g. truncated) and
   ``require_think_end`` is set. The answer is the text after the first ``</think>``.
3. ``no_boxed``: the answer has no well-formed ``\\boxed{...}`` / ``\\boxed x`` / ``\\fbox``;
   ``unparsable`` if the last box is empty. The prediction is the final group of boxes
   (``answer_extraction.final_boxes``): one box, or several chained by commas / "and" /
   "or", graded as the set of their contents.
4. ``too_long``: the boxed answer is longer than ``MAX_ANSWER_CHARS`` (a label that long is
   ``bad_label``).
5. ``wrong`` at once when the label's answers all end with a unit and a one-box answer
   ends with another (veto c: ``12 hours`` for ``12days``; math-verify drops both units).
6. The label's acceptable answers (a list label has several, see ``label_forms``) and the
   boxed answer are normalised (``label_forms.canonical``). Equal normalised text is ``ok``
   at once, and so is equal text for a label that is really text (``is_text_label``), and
   an answer that is exactly the label's value (plain decimals and integer fractions).
   These fast paths only ever say ``ok``: everything else goes to a grader process, which
   compares the normalised forms with math-verify (float rounding scaled to the label's
   magnitude) and, failing that, the label and boxes as written with plain math-verify, so
   that a "wrong" is never said where plain math-verify says "right", except for the
   documented vetoes (a small number that differs at six significant digits; a label with
   words that math-verify can only read as a bare number; another unit). The answer is
   also read with math-verify's grouping of boxes (words between them), and a label's
   value alone (``5`` of ``x = 5``) is never compared with an answer holding ``=``.
   ``ok`` / ``wrong`` /
   ``bad_label`` (math-verify extracts nothing from the label) / ``text_mismatch`` (a text
   label, or one holding letters that math-verify reads as a bare number, not matched) /
   ``unparsable`` (nothing from the answer) / ``timeout`` (deadline hit) / ``error``.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from fractions import Fraction

from drpo_openrlhf.rewards.answer_extraction import answer_part, final_boxes, to_text
from drpo_openrlhf.rewards.grader_pool import get_pool
from drpo_openrlhf.rewards.label_forms import (
    canonical,
    decimal_comma,
    decode_alternatives,
    exact_number,
    gold_parts,
    match_key,
    other_unit,
    text_key,
    unit_name,
)

DEFAULT_TIMEOUT_S = 5.0
"""Default per-response deadline (seconds of grader time)."""

MAX_ANSWER_CHARS = 2000
"""Boxed answers (and labels) longer than this are not handed to sympy: ``too_long``."""

REASONS = (
    "ok",
    "wrong",
    "no_think_end",
    "no_boxed",
    "unparsable",
    "too_long",
    "bad_label",
    "text_mismatch",
    "timeout",
    "error",
)
"""Every ``GradeResult.reason``; only ``"ok"`` is correct."""


@dataclass(frozen=True)
class GradeResult:
    """Outcome of grading one response: ``correct`` and why (one of ``REASONS``)."""

    correct: bool
    reason: str


OK = GradeResult(True, "ok")

_VERDICT_CACHE_SIZE = 16384
_FINAL_REASONS = frozenset({"ok", "wrong", "unparsable", "bad_label", "text_mismatch"})
"""Verdicts that do not depend on time or luck; only these are cached."""


Job = tuple[
    tuple[tuple[str, ...], tuple[str, ...]], tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]
]
"""What a grader process compares (see ``_grader_worker``): ``((golds, plain_golds),
(readings, parts))``: the label's normalised forms and its forms as written, the
prediction's normalised readings (each a tuple of box contents) and its boxes as written."""


class _Verdicts:
    """math-verify's verdicts per job (least recently used out first), and the jobs being
    graded now. The responses of a group often repeat one answer string, and OpenRLHF
    grades them in concurrent one-sample calls: a repeat takes the cached verdict, or waits
    for the grading already under way, instead of being graded again."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[Job, GradeResult] = OrderedDict()
        self._running: dict[tuple[Job, bool, float], Future] = {}
        self._lock = threading.Lock()

    def find_or_submit(
        self, job: Job, text_only: bool, timeout_s: float
    ) -> GradeResult | tuple[tuple[Job, bool, float], Future]:
        """The cached verdict, or the key and future of the grading of ``job`` (started
        here unless another call already did)."""
        key = (job, text_only, timeout_s)
        with self._lock:
            result = self._items.get(job)
            if result is not None:
                self._items.move_to_end(job)
                return result
            future = self._running.get(key)
            if future is None:
                future = get_pool().submit(job[0], job[1], timeout_s)
                self._running[key] = future
            return key, future

    def finish(self, key: tuple[Job, bool, float], future: Future, result: GradeResult) -> None:
        """Caches a final verdict, then forgets the running job (in that order, so that a
        concurrent repeat finds one or the other)."""
        job = key[0]
        with self._lock:
            if result.reason in _FINAL_REASONS:
                self._items[job] = result
                self._items.move_to_end(job)
                if len(self._items) > self.size:
                    self._items.popitem(last=False)
            if self._running.get(key) is future:
                del self._running[key]


_verdicts = _Verdicts(_VERDICT_CACHE_SIZE)


def env_timeout_s() -> float:
    """``$DRPO_REWARD_TIMEOUT_S`` if set to a positive number, else ``DEFAULT_TIMEOUT_S``."""
    try:
        value = float(os.environ.get("DRPO_REWARD_TIMEOUT_S", ""))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if math.isfinite(value) and value > 0 else DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class _Gold:
    """A label's canonical answers, the values it also accepts alone from an answer that is
    not an equation, its answers as written (for plain math-verify) and the keys of the text
    comparisons (cached per label: the responses of one group share it)."""

    math: tuple[str, ...]
    values: tuple[str, ...]
    text: tuple[str, ...]
    plain: tuple[str, ...]
    match_keys: frozenset[str]
    text_keys: frozenset[str]
    numbers: frozenset[Fraction]
    units: frozenset[str]
    """The unit names of the label's answers when each ends with a unit (else empty)."""


def _make_gold(label: object) -> _Gold:
    math_golds, values, text_golds = gold_parts(label)
    plain = decode_alternatives(label)
    units = [unit_name(answer) for answer in plain]
    # a value's key cannot match an equation's (no "="), so the fast paths may use values
    return _Gold(
        tuple(math_golds),
        tuple(values),
        tuple(text_golds),
        tuple(plain),
        frozenset(match_key(g) for g in math_golds + values + text_golds),
        frozenset(text_key(g) for g in text_golds),
        frozenset(n for n in map(exact_number, math_golds + values) if n is not None),
        frozenset(units) if all(units) else frozenset(),  # type: ignore[arg-type]
    )


_cached_gold = functools.lru_cache(maxsize=4096)(_make_gold)


def _gold(label: object) -> _Gold:
    return _cached_gold(label) if isinstance(label, str) else _make_gold(label)


def prepare(response: object, label: object, require_think_end: bool = True) -> GradeResult | Job:
    """Cheap checks done in the caller's thread.

    Returns a final ``GradeResult`` (``ok`` from a fast path, or a documented reason such
    as ``no_boxed``; never a plain "wrong") or the ``Job`` a grader process must decide.
    """
    gold = _gold(label)
    if not (gold.math or gold.text):
        return GradeResult(False, "bad_label")
    text = to_text(response) or ""
    answer = answer_part(text, require_think_end)
    if answer is None:
        return GradeResult(False, "no_think_end")
    boxes = final_boxes(answer)
    if boxes is None:
        return GradeResult(False, "no_boxed")
    if not boxes[-1].strip():
        return GradeResult(False, "unparsable")
    # a part boxed twice counts once; an empty box in the chain adds nothing
    parts = tuple(dict.fromkeys(p.strip() for p in boxes if p.strip()))
    if sum(len(p) for p in parts) > MAX_ANSWER_CHARS:
        return GradeResult(False, "too_long")
    if any(len(g) > MAX_ANSWER_CHARS for g in gold.math + gold.text + gold.plain):
        return GradeResult(False, "bad_label")
    if len(parts) == 1 and other_unit(gold.units, parts[0]):
        return GradeResult(False, "wrong")  # "12 hours" for "12days" (veto c, docs/rewards.md)
    canonical_parts = tuple(canonical(p) for p in parts)
    if ",".join(match_key(p) for p in canonical_parts) in gold.match_keys:
        return OK
    if gold.text and text_key(", ".join(parts)) in gold.text_keys:
        return OK
    if gold.numbers and len(parts) == 1 and exact_number(canonical_parts[0]) in gold.numbers:
        return OK
    readings = [canonical_parts]
    dotted = decimal_comma(canonical_parts[0]) if len(parts) == 1 else None
    if dotted is not None:
        readings.append((dotted,))
    # math-verify's wider grouping: boxes with words between them (a multi-part label)
    loose = tuple(
        dict.fromkeys(p.strip() for p in final_boxes(answer, loose=True) or () if p.strip())
    )
    if len(loose) > len(parts) and sum(len(p) for p in loose) <= MAX_ANSWER_CHARS:
        readings.append(tuple(canonical(p) for p in loose))
    equation = any("=" in p for p in canonical_parts)
    golds = gold.math + (() if equation else gold.values) + gold.text
    return (golds, gold.plain), (tuple(readings), parts)


def grade_responses(
    responses: Sequence[str],
    labels: Sequence[str],
    *,
    require_think_end: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[GradeResult]:
    """Grade R1-style ``responses`` against math ``labels`` (boxed or not).

    ``responses`` are model outputs only (no prompt). ``require_think_end=False`` is for
    non-thinking models: the whole response is the answer when there is no ``</think>``.
    Each response gets at most ``timeout_s`` seconds of grader time (plus a small grace
    for killing a stuck grader); responses beyond the pool size queue. Thread-safe; the
    content of a response or label never raises (failures are ``GradeResult``s), but a
    length mismatch or a non-positive ``timeout_s`` is a ``ValueError``.
    """
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
    timeout_s = float(timeout_s)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s}")

    results: list[GradeResult | None] = [None] * len(responses)
    waiting: dict[tuple[Job, bool, float], tuple[Future, list[int]]] = {}
    for i, (response, label) in enumerate(zip(responses, labels, strict=True)):
        try:
            prepared = prepare(response, label, require_think_end)
            if not isinstance(prepared, GradeResult):
                prepared = _verdicts.find_or_submit(prepared, not _gold(label).math, timeout_s)
        except Exception:
            prepared = GradeResult(False, "error")
        if isinstance(prepared, GradeResult):
            results[i] = prepared
        else:
            key, future = prepared
            waiting.setdefault(key, (future, []))[1].append(i)

    for key, (future, indices) in waiting.items():
        try:
            correct, reason = get_pool().wait(future)
        except Exception:
            correct, reason = False, "error"
        if reason == "wrong" and key[1]:
            reason = "text_mismatch"  # a text label: logged apart from math answers
        result = OK if correct else GradeResult(False, reason)
        _verdicts.finish(key, future, result)
        for i in indices:
            results[i] = result
    return results  # type: ignore[return-value]
