"""``drpo-data audit FILE...``: grade every label of prepared files against itself.

Each acceptable answer of each label is boxed and graded by the math reward as the model's
answer, together with a few rewrites a correct model may produce (trailing period, other
spacing, scientific notation both ways, the value of a ``name = value`` label), and with
answers it must reject (the number off by 50%; ``0`` and ``2`` for labels with letters).
A label the reward cannot handle shows up here before any GPU time is spent. Labels graded
by normalised text only (words, or nothing math-verify can parse) are listed as notes: an
equivalent answer in another form scores 0 for them. Exit status: 0 every label graded as
expected, 1 some did not, 2 a file cannot be read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from drpo_openrlhf.rewards.grading import grade_responses
from drpo_openrlhf.rewards.label_forms import canonical, decode_alternatives, gold_forms

_NAME_EQ = re.compile(r"\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*([^=]+)")


@dataclass(frozen=True)
class Finding:
    """One answer graded against a label other than expected."""

    location: str
    label: str
    answer: str
    expected: bool
    reason: str

    def __str__(self) -> str:
        what = "rejects" if self.expected else "accepts"
        return f"{self.location}: label {self.label!r} {what} {self.answer!r} ({self.reason})"


def _number(text: str) -> Decimal | None:
    try:
        value = Decimal(canonical(text))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


_LIST_COMMA = re.compile(r",\s*(?!\\!|\d{3}(?!\d))")
"""A comma that separates items, not thousands (``10,\\!080``, ``1,000``): a space after a
thousands comma makes a list of it (math-verify reads ``10, \\!080`` as ``{10, 80}``)."""


def _scientific(value: Decimal) -> list[str]:
    mantissa, exponent = f"{value:e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa
    power = int(exponent)
    return [f"{mantissa}e{power}", f"{mantissa} \\times 10^{{{power}}}"]


def probes(answer: str) -> tuple[list[str], list[str]]:
    """``(must_accept, must_reject)`` answers for one acceptable answer of a label."""
    accept = [answer, answer + ".", " ".join(answer.split()), _LIST_COMMA.sub(", ", answer)]
    reject: list[str] = []
    value = _number(answer)
    if value is not None:
        if value != 0 and (abs(value) < Decimal("1e-3") or abs(value) >= Decimal("1e5")):
            accept += _scientific(value)
        reject.append(str(value * Decimal("1.5") + (1 if value >= 0 else -1)))
    elif re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", answer)):
        reject += ["0", "2"]
    named = _NAME_EQ.fullmatch(answer)
    if named:
        accept.append(named.group(1).strip())
    return list(dict.fromkeys(accept)), reject


def text_only(label: str) -> bool:
    """Whether no acceptable answer of ``label`` is graded by math-verify: words, or nothing
    it can parse (main thread only: ``parse`` uses SIGALRM)."""
    from math_verify import parse

    math_forms, _ = gold_forms(label)
    return not any(
        any(not isinstance(item, str) for item in parse("\\boxed{" + form + "}"))
        for form in math_forms
    )


def audit_file(path: Path) -> tuple[int, list[Finding], list[str]]:
    """``(labels audited, findings, notes)`` for one prepared JSONL file."""
    cases: list[tuple[str, str, str, bool]] = []
    notes: list[str] = []
    n_labels = 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        label = json.loads(line)["label"]
        n_labels += 1
        if text_only(label):
            notes.append(f"{path} line {number}: label {label!r} is graded as text only")
        for answer in decode_alternatives(label):
            accept, reject = probes(answer)
            where = f"{path} line {number}"
            cases += [(where, label, a, True) for a in accept]
            cases += [(where, label, r, False) for r in reject]
    results = grade_responses(
        [f"</think>\\boxed{{{answer}}}" for _, _, answer, _ in cases],
        [label for _, label, _, _ in cases],
    )
    findings = [
        Finding(where, label, answer, expected, result.reason)
        for (where, label, answer, expected), result in zip(cases, results, strict=True)
        if result.correct != expected
    ]
    return n_labels, findings, notes


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="drpo-data audit",
        description="Grade every label of prepared JSONL files against itself and rewrites.",
    )
    parser.add_argument("files", nargs="+", type=Path, help="files written by drpo-data")
    parser.add_argument("--show", type=int, default=50, metavar="N", help="findings per file")
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        try:
            n_labels, findings, notes = audit_file(path)
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"error: {path}: cannot audit: {type(err).__name__}: {err}", file=sys.stderr)
            return 2
        for line in [*map(str, findings), *notes][: args.show]:
            print(line)
        if len(findings) + len(notes) > args.show:
            print(f"... and {len(findings) + len(notes) - args.show} more in {path}")
        labels = len({(f.location, f.label) for f in findings})
        kinds = Counter("rejects" if f.expected else "accepts" for f in findings)
        detail = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())) or "none"
        print(
            f"{path}: {n_labels} labels, {labels} with findings (answers: {detail}), "
            f"{len(notes)} graded as text only"
        )
        failed = failed or bool(findings)
    return 1 if failed else 0
