"""Turning one raw math record into the ``prompt`` / ``label`` / ``datasource`` row we write.

Column names differ between datasets and between the Hub and the copies people keep
(``problem`` vs ``question`` vs ``Problem``), so each source lists the keys it accepts, in
order. Answers are normalised to the bare answer string the reward compares against: numbers
become their decimal text (AMC stores ``142.0``), unescaped ``$`` delimiters are removed
(OlympiadBench writes ``$\\frac{1}{2}$``), a list of answers is joined with ``", "``, and
GSM8K keeps only the text after ``####``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MATH_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


class RowError(Exception):
    """A row that cannot be used; ``kind`` names the problem for the summary."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class Excluded(Exception):
    """A valid row that the chosen options leave out (e.g. K&K puzzle size outside the range)."""


@dataclass(frozen=True)
class Converted:
    """A usable row: ``problem`` is kept (without suffix) for duplicate detection."""

    problem: str
    prompt: str
    label: str
    datasource: str


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def pick(record: dict, keys: Sequence[str], what: str) -> tuple[str, object]:
    """The first of ``keys`` present with a non-null value, else a ``missing`` RowError."""
    for key in keys:
        if record.get(key) is not None:
            return key, record[key]
    looked = ", ".join(repr(k) for k in keys)
    raise RowError("missing", f"{what} is missing (looked for {looked})")


def require_text(record: dict, keys: Sequence[str], what: str) -> str:
    """A non-empty string field, stripped."""
    key, value = pick(record, keys, what)
    if not isinstance(value, str):
        raise RowError(
            "wrong_type", f"{what} field {key!r} is {_type_name(value)}, expected a string"
        )
    if not value.strip():
        raise RowError("empty", f"{what} field {key!r} is empty")
    return value.strip()


def answer_text(value: object, key: str, allow_list: bool = False) -> str:
    """The bare answer string of a scalar (or, where allowed, a list of scalars)."""
    if isinstance(value, bool):
        raise RowError("wrong_type", f"answer field {key!r} is bool, expected a string or number")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RowError("wrong_type", f"answer field {key!r} is {value}, not a finite number")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return _UNESCAPED_DOLLAR.sub("", value).strip()
    if isinstance(value, list) and allow_list:
        parts = [answer_text(item, key) for item in value]
        if not all(parts):
            raise RowError("empty", f"answer field {key!r} holds an empty item")
        return ", ".join(parts)
    expected = "a string, number or list of them" if allow_list else "a string or number"
    raise RowError(
        "wrong_type", f"answer field {key!r} is {_type_name(value)}, expected {expected}"
    )


def answer_list_text(value: object, key: str) -> str:
    """``answer_text`` that also joins a list of answers (OlympiadBench's ``final_answer``)."""
    return answer_text(value, key, allow_list=True)


def gsm8k_final_answer(value: object, key: str) -> str:
    """The text after the last ``####`` of a GSM8K solution.

    A copy that already holds only the final answer (a number, or one token without
    ``####``) is accepted; a longer text without the marker is ambiguous and rejected.
    """
    if not isinstance(value, str):
        return answer_text(value, key)
    if "####" in value:
        return value.rsplit("####", 1)[1].strip()
    if len(value.split()) <= 1:
        return value.strip()
    preview = value if len(value) <= 60 else value[:57] + "..."
    raise RowError("bad_format", f"GSM8K answer has no '####' final-answer marker: {preview!r}")


Converter = Callable[[dict], Converted]


def math_converter(
    datasource: str,
    problem_keys: Sequence[str],
    answer_keys: Sequence[str],
    answer: Callable[[object, str], str] = answer_text,
) -> Converter:
    """A converter for a math source: problem + the authors' suffix, normalised answer."""

    def convert(record: dict) -> Converted:
        problem = require_text(record, problem_keys, "problem")
        key, raw = pick(record, answer_keys, "answer")
        label = answer(raw, key)
        if not label:
            raise RowError("empty", f"answer field {key!r} is empty")
        return Converted(problem, problem + MATH_SUFFIX, label, datasource)

    return convert
