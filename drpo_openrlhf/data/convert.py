"""Turning one raw math record into the ``prompt`` / ``label`` / ``datasource`` row we write.

Column names differ between datasets and between the Hub and the copies people keep
(``problem`` vs ``question`` vs ``Problem``), so each source lists the keys it accepts, in
order. Answers are normalised to the bare answer string the reward compares against: numbers
become their decimal text (AMC stores ``142.0``), unescaped ``$`` delimiters are removed
(OlympiadBench writes ``$\\frac{1}{2}$``), a list of answers is joined with ``", "``, and
GSM8K keeps only the text after ``####``.

Rows in verl's layout (the DRPO authors' released parquet/JSON files) are recognised by a
``prompt`` that is a list of chat messages and a ``reward_model.ground_truth``: the prompt
is the single user message, kept exactly (it already carries the instruction suffix), the
label is the ground truth, and the datasource is ``data_source`` when it is not empty. A
list of answers in ``ground_truth`` (or in Minerva's ``answer``) is a list of *acceptable*
answers and is written with ``encode_alternatives`` (a JSON array of strings).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from drpo_openrlhf.rewards.label_forms import encode_alternatives

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
    """A usable row: ``problem`` is kept (without suffix) for duplicate detection;
    ``alternatives`` counts the acceptable answers a list label holds (1: a plain label)."""

    problem: str
    prompt: str
    label: str
    datasource: str
    alternatives: int = 1


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def pick(record: dict, keys: Sequence[str], what: str, also: str = "") -> tuple[str, object]:
    """The first of ``keys`` present with a non-null value, else a ``missing`` RowError
    naming the keys looked for (and ``also``, another accepted layout) and those found."""
    for key in keys:
        if record.get(key) is not None:
            return key, record[key]
    looked = ", ".join(repr(k) for k in keys) + (f", or {also}" if also else "")
    found = ", ".join(repr(k) for k in record) or "none"
    raise RowError("missing", f"{what} is missing (looked for {looked}; found {found})")


def require_text(record: dict, keys: Sequence[str], what: str, also: str = "") -> str:
    """A non-empty string field, stripped."""
    key, value = pick(record, keys, what, also)
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


def answer_alternatives(value: object, key: str) -> str:
    """``answer_text``, except that a list holds acceptable answers (any one is correct)
    and is encoded with ``encode_alternatives``."""
    if not isinstance(value, list):
        return answer_text(value, key)
    parts = [answer_text(item, key) for item in value]
    if not parts or not all(parts):
        raise RowError("empty", f"answer field {key!r} is an empty list or holds an empty item")
    return encode_alternatives(parts)


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


VERL_LAYOUT = "a chat-message list 'prompt' with 'reward_model.ground_truth' (verl)"


def _count_alternatives(label: str) -> int:
    return len(json.loads(label)) if label.startswith('["') else 1


def _is_verl(record: dict) -> bool:
    return isinstance(record.get("prompt"), list) and "reward_model" in record


def _verl_prompt(messages: list) -> str:
    """The text of the only message, which must be the user's."""
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if roles != ["user"]:
        raise RowError(
            "bad_format",
            f"prompt has messages with roles {roles}; only a single user message is supported",
        )
    content = messages[0].get("content")
    if not isinstance(content, str):
        raise RowError("wrong_type", f"prompt message content is {_type_name(content)}")
    if not content.strip():
        raise RowError("empty", "prompt message content is empty")
    return content


def _verl_row(record: dict, datasource: str, answer: Callable[[object, str], str]) -> Converted:
    prompt = _verl_prompt(record["prompt"])
    reward_model = record["reward_model"]
    if not isinstance(reward_model, dict):
        raise RowError(
            "wrong_type", f"reward_model is {_type_name(reward_model)}, expected an object"
        )
    key = "reward_model.ground_truth"
    raw = reward_model.get("ground_truth")
    if raw is None:
        raise RowError("missing", f"{key} is missing")
    label = answer_alternatives(raw, key) if isinstance(raw, list) else answer(raw, key)
    if not label:
        raise RowError("empty", f"{key} is empty")
    source = record.get("data_source")
    problem = prompt.strip()
    if problem.endswith(MATH_SUFFIX.strip()):
        problem = problem[: -len(MATH_SUFFIX.strip())].strip()
    return Converted(
        problem,
        prompt,
        label,
        source if isinstance(source, str) and source.strip() else datasource,
        _count_alternatives(label),
    )


def math_converter(
    datasource: str,
    problem_keys: Sequence[str],
    answer_keys: Sequence[str],
    answer: Callable[[object, str], str] = answer_text,
) -> Converter:
    """A converter for a math source: problem + the authors' suffix, normalised answer; or
    a verl row, whose prompt already carries the suffix."""

    def convert(record: dict) -> Converted:
        if _is_verl(record):
            return _verl_row(record, datasource, answer)
        problem = require_text(record, problem_keys, "problem", VERL_LAYOUT)
        text = record[pick(record, problem_keys, "problem")[0]]  # unstripped, as the authors
        key, raw = pick(record, answer_keys, "answer")
        label = answer(raw, key)
        if not label:
            raise RowError("empty", f"answer field {key!r} is empty")
        return Converted(problem, text + MATH_SUFFIX, label, datasource, _count_alternatives(label))

    return convert
