"""Label and answer normalisation done before math-verify sees them (see docs/rewards.md).

Real labels are not all in the bare-LaTeX form math-verify expects: Minerva keeps a list of
acceptable answers, writes scientific notation as ``4.4e7`` or ``4.4 \\times 10^7`` and
appends units (``\\text{ cm}^{-3}``, ``Hz``); other sets end labels with a period or write
``y = ...``. Everything here is linear-time string work in the caller's thread, imports
only the standard library, and never decides that two answers *differ*: it only rewrites
them so that math-verify compares what was meant, or accepts identical normalised text.

**List encoding.** OpenRLHF hands labels to the reward as strings, so a label with several
acceptable answers is written as a JSON array of strings (``["0.01", "0.02"]``); a response
is correct if it matches any of them. A label is read as such a list only if it starts with
``["`` and parses as a JSON array of strings (no LaTeX answer has that form).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from drpo_openrlhf.rewards.answer_extraction import normalize_label, to_text

MAX_EXPONENT = 400
"""Scientific notation with a larger exponent is left to math-verify as written."""

_SPACING = re.compile(r"\\\\|\\[,;:! ]|\\q?quad(?![A-Za-z])|~")  # ``\\`` is kept
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_SMALL_FRAC = re.compile(r"\\[dt]frac(?![A-Za-z])")
_DEGREE = re.compile(r"\^\s*\{\s*\\circ\s*\}")
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_SCI = re.compile(
    rf"({_NUMBER})\s*(?:[eE]\s*([+-]?\d+)"
    r"|(?:\\times|\\cdot|\*|×)\s*10\s*\^\s*(?:\{\s*([+-]?\d+)\s*\}|([+-]?\d)))"
)
_POW10 = re.compile(r"10\s*\^\s*(?:\{\s*([+-]?\d+)\s*\}|([+-]?\d))")
_TEXT_GROUP = r"\\(?:text|textnormal|mbox|mathrm|textrm|rm)\s*\{[^{}]*\}"
_EXPONENT = r"(?:\s*\^\s*(?:\{[^{}]*\}|-?\d))?"
_UNIT_TAIL = re.compile(rf"(?:\s*{_TEXT_GROUP}{_EXPONENT})+\s*$")
_UNIT_WORD = r"(?:[A-Za-z]{2,5}|[mgsKJNWVAL])"  # one-letter words are variables, but SI units
_PLAIN_UNIT_TAIL = re.compile(rf"(?:\s+{_UNIT_WORD}{_EXPONENT}(?:\s*/\s*{_UNIT_WORD})?)+\s*$")
_NAME = r"(?:[A-Za-z]|\\[A-Za-z]+)(?:_\s*(?:\{[A-Za-z0-9,\\ ]+\}|[A-Za-z0-9]))?'*"
_NAME_EQ = re.compile(rf"\s*{_NAME}(?:\s*\(\s*[A-Za-z]\s*\))?\s*=\s*([^=<>]+)")
_TEXT_WRAPPER = re.compile(
    r"\\(?:text|textnormal|mbox|textbf|textit|mathrm|textrm|mathbf)\s*\{([^{}]*)\}"
)
# A label that is really text once its wrappers are gone: words (names, directions, "yes"),
# or one multiple-choice letter, with spaces and light punctuation; no digits, no math.
_WORDS = re.compile(r"[A-Za-z][A-Za-z' ,.;:!?()-]*")
_WORD = re.compile(r"[A-Za-z]{2,}")
_CHOICE = re.compile(r"\(?[A-E]\)?")
# Thousands separators as MATH writes them: "11,\\! 111,\\! 100", "1{,}000".
_THOUSANDS = re.compile(r"(?<=\d)(?:,\\!|\{,\})\s*(?=\d{3}(?!\d))")
# "$125$ miles": the answer in math, a unit or description after it in words.
_MATH_THEN_WORDS = re.compile(r"\$([^$]+)\$\s*[A-Za-z][A-Za-z .-]*")
# "1000,99" or "3,14159": one comma with other than three digits after it (no space).
# A rational number the fast path can compare exactly: 12, -0.75, .5, \frac{3}{4}, -\frac{-3}{4}.
_FRACTION = re.compile(r"([+-]?)\\frac\s*\{\s*([+-]?\d{1,30})\s*\}\s*\{\s*([+-]?\d{1,30})\s*\}")
_DECIMAL = re.compile(r"[+-]?(?:\d{1,60}(?:\.\d{0,60})?|\.\d{1,60})")
_DECIMAL_COMMA = re.compile(r"([+-]?\d+),(\d{1,2}|\d{4,})")
_TEXT_NOISE = re.compile(r"[\s$(){}.,;:!\\]")


def encode_alternatives(answers: Iterable[str]) -> str:
    """The label string for a list of acceptable answers (one answer: the answer itself)."""
    unique = list(dict.fromkeys(a.strip() for a in answers if a and a.strip()))
    if len(unique) == 1:
        return unique[0]
    return json.dumps(unique, ensure_ascii=False)


def decode_alternatives(label: object) -> list[str]:
    """Every acceptable answer of ``label`` as bare LaTeX (empty list: no usable label).

    ``label`` may be a list/tuple of answers, the JSON-array encoding of one, or a single
    answer (boxed or ``$...$``-wrapped answers are unwrapped by ``normalize_label``).
    """
    if isinstance(label, (list, tuple)):
        items: list[object] = list(label)
    else:
        text = to_text(label)
        items = [text]
        if text is not None and text.lstrip().startswith('["'):
            try:
                decoded = json.loads(text)
            except ValueError:
                decoded = None
            if isinstance(decoded, list) and decoded and all(isinstance(d, str) for d in decoded):
                items = list(decoded)
    out: list[str] = []
    for item in items:
        raw = to_text(item)
        text = normalize_label(_strip_punctuation(raw)) if raw is not None else None
        if text is not None and text not in out:
            out.append(text)
    return out


def _strip_punctuation(text: str) -> str:
    text = text.strip()
    while text and text[-1] in ".,;" and not text.endswith("...") and not text.endswith("\\."):
        text = text[:-1].rstrip()
    return text


def _scientific_to_decimal(text: str) -> str:
    """``2.88e-19`` / ``2.88 \\times 10^{-19}`` / ``10^{-3}`` as plain decimal text, when
    ``text`` is exactly such a number; math-verify reads ``e`` as Euler's number and keeps
    ``10^{-19}`` symbolic, which makes it compare small values on an absolute scale."""
    match = _SCI.fullmatch(text)
    if match:
        mantissa, exponent = match.group(1), match.group(2) or match.group(3) or match.group(4)
    else:
        match = _POW10.fullmatch(text)
        if not match:
            return text
        mantissa, exponent = "1", match.group(1) or match.group(2)
    if abs(int(exponent)) > MAX_EXPONENT:
        return text
    try:
        value = Decimal(mantissa).scaleb(int(exponent))
    except InvalidOperation:
        return text
    plain = format(value, "f")
    if "." in plain:
        plain = plain.rstrip("0").rstrip(".") or "0"
    return plain


def _is_number(text: str) -> bool:
    return bool(re.fullmatch(_NUMBER, text) or _SCI.fullmatch(text) or _POW10.fullmatch(text))


def _strip_units(text: str) -> str:
    """Drop trailing ``\\text{...}`` unit groups, and plain unit words after a number."""
    head = _UNIT_TAIL.sub("", text).strip()
    if head and head != text and head[-1] in "0123456789})":
        text = head
    head = _PLAIN_UNIT_TAIL.sub("", text).strip()
    if head and head != text and _is_number(head):
        text = head
    return text


def canonical(text: str) -> str:
    """``text`` with layout-only differences removed: spacing commands, ``\\left``/
    ``\\right``, ``\\dfrac``, ``^{\\circ}``, trailing punctuation, trailing units, and
    scientific notation written out as a decimal; thousands separators (``,\\!``, ``{,}``)
    dropped and a ``$125$ miles`` label read as its math."""
    words = _MATH_THEN_WORDS.fullmatch(text.strip())
    if words:
        text = words.group(1)
    text = _THOUSANDS.sub("", text)
    text = _SPACING.sub(lambda m: m.group() if m.group() == "\\\\" else " ", text)
    text = _LEFT_RIGHT.sub("", text)
    text = _SMALL_FRAC.sub("\\\\frac", text)
    text = _DEGREE.sub("^\\\\circ", text)
    text = _strip_punctuation(text)
    text = _strip_units(text)
    text = _strip_punctuation(text)
    return _scientific_to_decimal(text)


def match_key(text: str) -> str:
    """Key of the string fast path: canonical text without any whitespace."""
    return "".join(canonical(text).split())


def text_key(text: str) -> str:
    """Key for labels graded as text: wrappers, case, spaces and punctuation dropped."""
    return _TEXT_NOISE.sub("", _TEXT_WRAPPER.sub(r"\1", canonical(text))).lower()


def is_text_label(text: str) -> bool:
    """Whether a (canonical) label is really text: words (``\\text{Evelyn}``, ``east``) or a
    multiple-choice letter (``\\text{(C)}``), with no digits or math. Such labels also
    accept an answer whose text matches (case, spacing, wrappers aside); anything else,
    equations and named values included, is math-verify's to judge."""
    inner = _TEXT_WRAPPER.sub(r"\1", text).strip()
    if _CHOICE.fullmatch(inner):
        return True
    return bool(_WORDS.fullmatch(inner) and _WORD.search(inner))


def exact_number(text: str) -> Fraction | None:
    """The value of a (canonical) answer that is one plain decimal or ``\\frac{p}{q}`` of
    integers, else ``None``. Equal values are equal for math-verify too, so the fast path
    may call such an answer right without sympy."""
    text = "".join(text.split())
    if _DECIMAL.fullmatch(text):
        return Fraction(text)
    match = _FRACTION.fullmatch(text)
    if not match or int(match.group(3)) == 0:
        return None
    value = Fraction(int(match.group(2)), int(match.group(3)))
    return -value if match.group(1) == "-" else value


def decimal_comma(text: str) -> str | None:
    """``1000,99`` read with a decimal comma (``1000.99``), or ``None`` when ``text`` is not
    one number written that way (three digits after the comma are a thousands group)."""
    match = _DECIMAL_COMMA.fullmatch(text.strip())
    return f"{match.group(1)}.{match.group(2)}" if match else None


def gold_forms(label: object) -> tuple[list[str], list[str]]:
    """``(math_forms, text_forms)``: canonical alternatives math-verify grades, and those
    that are really text (also compared as text). A ``name = value`` label also accepts
    ``value`` alone, and a ``1000,99`` label its decimal-comma reading ``1000.99``."""
    math_forms: list[str] = []
    text_forms: list[str] = []
    for answer in decode_alternatives(label):
        form = canonical(answer)
        if not form:
            continue
        target = text_forms if is_text_label(form) else math_forms
        target.append(form)
        named = _NAME_EQ.fullmatch(form)
        if named and target is math_forms:
            value = canonical(named.group(1))
            if value and value not in math_forms:
                math_forms.append(value)
        dotted = decimal_comma(form)
        if dotted and dotted not in math_forms:
            math_forms.append(dotted)
    return list(dict.fromkeys(math_forms)), list(dict.fromkeys(text_forms))
