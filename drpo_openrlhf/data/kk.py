"""Knights-and-Knaves (K&K) logic puzzles: prompt suffix, label format and row conversion.

The K&K paper (Xie et al., 2024) asks the model to end with ``CONCLUSION:`` followed by one
numbered line per character; Logic-RL uses the same numbered lines. Our label is exactly that
block's body, built from the dataset's ``names`` and boolean ``solution`` columns::

    (1) Ella is a knight
    (2) Zoey is a knave

one line per inhabitant, numbered from 1 in the order of ``names`` (the order the quiz
introduces them), lines separated by ``\\n``, roles in lower case. ``parse_assignment`` reads
it back into ``{name: is_knight}``, so a reward can compare by name whatever the order of the
model's lines. This module imports nothing heavy: a reward running in a vLLM worker may use it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from drpo_openrlhf.data.convert import Converted, Converter, Excluded, RowError, require_text

KK_SUFFIX = (
    " Let's think step by step. At the end of your answer, state the identity of every"
    " inhabitant, one per line, in the order they were introduced, in the format:\n"
    "CONCLUSION:\n(1) <name> is a knight\n(2) <name> is a knave\n..."
)

_LINE = re.compile(r"\((\d+)\)\s*(\S.*?)\s+is\s+an?\s+(knight|knave)\.?", re.IGNORECASE)


def format_assignment(names: Sequence[str], knights: Sequence[bool]) -> str:
    """The label: ``(i) NAME is a knight|knave`` lines in the order of ``names``."""
    if len(names) != len(knights):
        raise ValueError(f"{len(names)} names but {len(knights)} roles")
    return "\n".join(
        f"({i}) {name} is a {'knight' if knight else 'knave'}"
        for i, (name, knight) in enumerate(zip(names, knights, strict=True), start=1)
    )


def parse_assignment(text: str) -> dict[str, bool]:
    """``{name: is_knight}`` from label-format lines; ValueError on any malformed line."""
    result: dict[str, bool] = {}
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        raise ValueError("no role assignment lines")
    for expected, line in enumerate(lines, start=1):
        match = _LINE.fullmatch(line)
        if match is None:
            raise ValueError(f"line {line!r} is not '(i) NAME is a knight|knave'")
        number, name, role = int(match[1]), match[2], match[3].lower()
        if number != expected:
            raise ValueError(f"line {line!r} is numbered {number}, expected {expected}")
        if name in result:
            raise ValueError(f"{name!r} is assigned twice")
        result[name] = role == "knight"
    return result


def _names(record: dict) -> list[str]:
    names = record.get("names")
    if names is None:
        raise RowError("missing", "names is missing")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RowError("wrong_type", "names must be a list of strings")
    if not names or not all(n.strip() and "\n" not in n for n in names):
        raise RowError("empty", "names must be non-empty single-line strings")
    if len(set(names)) != len(names):
        raise RowError("bad_format", f"names repeat: {names}")
    return names


def _solution(record: dict, count: int) -> list[bool]:
    solution = record.get("solution")
    if solution is None:
        raise RowError("missing", "solution is missing")
    if not isinstance(solution, list) or not all(isinstance(s, bool) for s in solution):
        raise RowError("wrong_type", "solution must be a list of booleans (true = knight)")
    if len(solution) != count:
        raise RowError("bad_format", f"solution has {len(solution)} entries for {count} names")
    return solution


def kk_converter(people: range) -> Converter:
    """A converter for K&K rows; puzzles whose size is outside ``people`` are Excluded."""

    def convert(record: dict) -> Converted:
        quiz = require_text(record, ("quiz",), "problem")
        names = _names(record)
        if len(names) not in people:
            raise Excluded(f"{len(names)}-person puzzle outside {people[0]}-{people[-1]}")
        label = format_assignment(names, _solution(record, len(names)))
        given = record.get("solution_text_format")
        if given is not None:
            try:
                consistent = parse_assignment(str(given)) == parse_assignment(label)
            except ValueError:
                consistent = False
            if not consistent:
                raise RowError("bad_format", "solution_text_format disagrees with names/solution")
        return Converted(quiz, quiz + KK_SUFFIX, label, f"kk_{len(names)}ppl")

    return convert
