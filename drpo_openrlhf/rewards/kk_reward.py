"""Knights and Knaves (K&K) logic-puzzle reward: OpenRLHF plugin and plain functions.

The K&K data (Xie et al. 2024, "On Memorization of Large Language Models in Logical
Reasoning"; Logic-RL) states solutions as ``solution_text_format``::

    (1) Ella is a knight
    (2) Zoey is a knave

or ``solution_text`` ("Ella is a knight, Zoey is a knave, and ..."). Labels may be either
text, a JSON object / dict with ``solution_text_format`` (Logic-RL ``ground_truth``),
``names`` + ``solution`` (booleans, True = knight), or ``{name: "knight" | "knave"}``.

The model's answer is the text after ``</think>``: within it, the last
``<answer>...</answer>`` if there is one, and within that what follows the last
``CONCLUSION:`` (the format ``drpo_openrlhf.data.kk`` prompts for). It is scanned left
to right, clause by clause, and the *last* assignment of each person wins. Recognised
phrasings include "(1) Zoey is a knight", "Zoey: Knave", "**Zoey** - knight",
"| Zoey | Knight |", "Zoey and Oliver are knights", "Knights: Zoey, Oliver",
"The knaves are Ella and Henry", "Zoey is not a knave", "truth-teller" / "liar".
Clauses that report speech ("Zoey says Oliver is a knave") or are hypothetical
("if Zoey is a knight ...", "either ... or ...") assign nothing.

A response is correct when every person of the solution is assigned the right role.
Reasons: ``ok``, ``wrong`` (someone has the wrong role), ``incomplete`` (someone has no
role), ``no_think_end``, ``bad_label``, ``error``.

As an OpenRLHF plugin: ``--reward.remote_url /path/to/drpo_openrlhf/rewards/kk_reward.py``.
For a model that does not think (``require_think_end=False``, which our entry point passes
as ``--drpo.answer_format`` decides; ``DRPO_REWARD_REQUIRE_THINK_END=0`` with stock
OpenRLHF) the answer is the whole response, or the text after a ``</think>`` if one is
written.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

try:
    import drpo_openrlhf.rewards.grading  # noqa: F401
except ImportError:  # loaded by path from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from drpo_openrlhf.rewards._plugin import (
    as_list,
    build_output,
    env_flag,
    query_count,
    responses_from_queries,
)
from drpo_openrlhf.rewards.answer_extraction import answer_part, to_text
from drpo_openrlhf.rewards.grading import GradeResult

__all__ = [
    "KK_REASONS",
    "LOG_PREFIX",
    "GradeResult",
    "grade_kk",
    "grade_kk_responses",
    "parse_kk_answer",
    "parse_kk_label",
    "reward_func",
]

KK_REASONS = ("ok", "wrong", "incomplete", "no_think_end", "bad_label", "error")
LOG_PREFIX = "kk"
MAX_ANSWER_CHARS = 20_000
"""Only the last this-many characters of an answer are scanned."""

_KNIGHT_WORDS = ("knight", "truth-teller", "truthteller", "truth teller")
_ROLE = r"(?:knights?|knaves?|truth[- ]?tellers?|liars?)"
_LABEL_RE = re.compile(
    r"(?<![\w'-])([A-Z][\w'-]*)\s+(?i:is|was)\s+(?i:a|an|the)\s+((?i:" + _ROLE + r"))\b"
)
_ANSWER_OPEN = re.compile(r"<answer>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"</answer>", re.IGNORECASE)
_CONCLUSION = re.compile(r"\bconclusion\s*:", re.IGNORECASE)
_HEADER_AFTER_ROLE = re.compile(r"[\s*_]*(?::|=|-|–|—|\bare\b|\bis\b)", re.IGNORECASE)
_EVENTS = (
    r"(?P<role>(?i:\b" + _ROLE + r"\b))"
    r"|(?P<neg>(?i:\b(?:not|never|cannot|neither|nor)\b|n't\b|\bisnt\b))"
    r"|(?P<speech>(?i:\b(?:says?|said|claims?|claimed|states?|stated|tells?|told|thinks?"
    r"|thought|believes?|believed|asserts?|asserted|declares?|declared|mentions?|mentioned"
    r"|insists?|insisted|accuses?|accused|argues?|argued)\b)|[\"“”«»])"
    r"|(?P<hyp>(?i:\b(?:if|assume|assuming|assumed|suppose|supposing|would|could|might"
    r"|whether|either|unless|possibly|maybe)\b))"
    r"|(?P<sep>[.;!?\n]|\(\d+\)|(?i:\b(?:so|therefore|thus|hence)\b))"
)


def _is_knight(role_word: str) -> bool:
    return role_word.lower().rstrip("s").startswith(_KNIGHT_WORDS)


def _label_from_mapping(label: Mapping) -> dict[str, bool] | None:
    for key in ("solution_text_format", "solution_text", "ground_truth"):
        if key in label:
            return parse_kk_label(label[key])
    names, solution = label.get("names"), label.get("solution")
    if isinstance(names, Sequence) and isinstance(solution, Sequence):
        if len(names) != len(solution) or not names:
            return None
        return {str(n): bool(s) for n, s in zip(names, solution, strict=True)}
    out = {}
    for name, role in label.items():
        role_text = to_text(role)
        if not isinstance(name, str) or role_text is None:
            return None
        role_text = role_text.strip().lower()
        if not re.fullmatch(_ROLE, role_text):
            return None
        out[name] = _is_knight(role_text)
    return out or None


def parse_kk_label(label: object) -> dict[str, bool] | None:
    """``{name: is_knight}`` in the solution's order, or ``None`` if unusable."""
    if isinstance(label, Mapping):
        return _label_from_mapping(label)
    text = to_text(label)
    if text is None:
        return None
    text = text.strip()
    if text[:1] in "{[":
        try:
            decoded = json.loads(text)
        except ValueError:
            decoded = None
        if isinstance(decoded, Mapping):
            return _label_from_mapping(decoded)
        if isinstance(decoded, str):
            text = decoded
    out: dict[str, bool] = {}
    for match in _LABEL_RE.finditer(text):
        name, role = match.group(1), match.group(2)
        if name not in ("It", "He", "She", "This", "That", "There", "Who"):
            out[name] = _is_knight(role)
    return out or None


@functools.lru_cache(maxsize=1024)
def _event_regex(names: tuple[str, ...]) -> re.Pattern:
    alternation = "|".join(re.escape(n) for n in sorted(set(names), key=len, reverse=True))
    return re.compile(r"(?P<name>(?<![\w'-])(?:" + alternation + r")(?![\w-]))|" + _EVENTS)


def parse_kk_answer(text: str, names: Sequence[str]) -> dict[str, bool]:
    """The roles ``text`` assigns to ``names`` (``{name: is_knight}``; last one wins)."""
    if not names:
        return {}
    assigned: dict[str, bool] = {}
    subjects: list[str] = []  # names waiting for their role ("Zoey and Oliver are ...")
    negated = blocked = False
    header: bool | None = None  # a role announced before its names ("Knights: A, B")
    header_names: list[str] = []
    for m in _event_regex(tuple(names)).finditer(text):
        kind = m.lastgroup
        if kind == "sep":
            subjects, negated, blocked, header, header_names = [], False, False, None, []
        elif kind == "name":
            if blocked:
                continue
            if header is not None:
                assigned[m.group()] = header
                header_names.append(m.group())
            else:
                subjects.append(m.group())
        elif kind == "neg":
            negated = True
        elif kind in ("speech", "hyp"):
            subjects, negated, blocked, header, header_names = [], False, True, None, []
        elif kind == "role":
            knight = _is_knight(m.group())
            if blocked:
                subjects = []
            elif subjects:
                for name in subjects:
                    assigned[name] = knight != negated
                subjects = []
            elif _HEADER_AFTER_ROLE.match(text, m.end()):
                header, header_names = knight, []
            elif header is not None and header_names:
                # "The knights are A and B, and C is a knave": the role is C's own.
                assigned[header_names[-1]] = knight != negated
                header, header_names = None, []
            negated = False
    return assigned


def _answer_region(answer: str) -> str:
    """The last ``MAX_ANSWER_CHARS`` of the answer, narrowed to its last ``<answer>`` block
    and then to what follows its last ``CONCLUSION:``, when there are such markers."""
    answer = answer[-MAX_ANSWER_CHARS:]
    start = -1
    for m in _ANSWER_OPEN.finditer(answer):
        start = m.end()
    if start != -1:
        close = _ANSWER_CLOSE.search(answer, start)
        answer = answer[start : close.start() if close else len(answer)]
    start = -1
    for m in _CONCLUSION.finditer(answer):
        start = m.end()
    return answer if start == -1 else answer[start:]


def grade_kk(response: object, label: object, *, require_think_end: bool = True) -> GradeResult:
    """Grade one K&K response (model output only, no prompt) against its solution."""
    try:
        solution = parse_kk_label(label)
        if not solution:
            return GradeResult(False, "bad_label")
        answer = answer_part(to_text(response) or "", require_think_end)
        if answer is None:
            return GradeResult(False, "no_think_end")
        assigned = parse_kk_answer(_answer_region(answer), list(solution))
        if any(name in assigned and assigned[name] != role for name, role in solution.items()):
            return GradeResult(False, "wrong")
        if len(assigned) < len(solution):
            return GradeResult(False, "incomplete")
        return GradeResult(True, "ok")
    except Exception:
        return GradeResult(False, "error")


def grade_kk_responses(
    responses: Sequence[str], labels: Sequence[object], *, require_think_end: bool = True
) -> list[GradeResult]:
    """Batch version of :func:`grade_kk`."""
    if len(responses) != len(labels):
        raise ValueError(f"{len(responses)} responses but {len(labels)} labels")
    return [
        grade_kk(r, lab, require_think_end=require_think_end)
        for r, lab in zip(responses, labels, strict=True)
    ]


def reward_func(queries, prompts, labels, **kwargs) -> dict:
    """OpenRLHF reward plugin for K&K: 1.0 when every role is right, else 0.0.

    Same contract as ``math_reward.reward_func``: ``extra_logs`` has ``kk/<reason>`` for
    every reason in ``KK_REASONS`` plus ``kk/prompt_not_found`` and ``kk/seconds``; never
    raises. Option ``require_think_end`` (default from ``DRPO_REWARD_REQUIRE_THINK_END``).
    """
    start = time.perf_counter()
    queries, n = query_count(queries)
    found = [False] * n
    try:
        require_think_end = kwargs.get("require_think_end")
        if require_think_end is None:
            require_think_end = env_flag("DRPO_REWARD_REQUIRE_THINK_END", True)
        responses, found = responses_from_queries(queries, as_list(prompts, n))
        results = grade_kk_responses(
            responses, as_list(labels, n), require_think_end=bool(require_think_end)
        )
    except Exception:
        results = [GradeResult(False, "error")] * n
    elapsed = time.perf_counter() - start
    return build_output(
        [r.correct for r in results],
        [r.reason for r in results],
        LOG_PREFIX,
        KK_REASONS,
        {"prompt_not_found": [0.0 if f else 1.0 for f in found], "seconds": [elapsed] * n},
    )
