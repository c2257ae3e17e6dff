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
_UNIT_WORD = r"(?:[A-Za-z]{2,}|[mgsKJNWVAL])"  # one-letter words are variables, but SI units
_PLAIN_UNIT_TAIL = re.compile(rf"(?:\s+{_UNIT_WORD}{_EXPONENT}(?:\s*/\s*{_UNIT_WORD})?)+\s*$")
# A unit glued to its number ("12days", "5cm^2"): only these words, since "2ab" is a product.
_GLUED_UNIT = re.compile(
    rf"({_NUMBER})(?:(?:milli|centi|kilo)?(?:meter|metre|gram|liter|litre)s?|[mck]m|kg|mg|ml"
    r"|days?|hours?|hrs?|minutes?|mins?|seconds?|secs?|weeks?|months?|years?|yrs?"
    r"|miles?|mph|feet|foot|ft|inch(?:es)?|yards?|pounds?|lbs?|ounces?|oz|gallons?|acres?"
    rf"|dollars?|cents?|degrees?|units?|people|persons?|times|ways){_EXPONENT}"
)
# Names whose value a ``name = value`` label also accepts alone: a letter or command with a
# subscript and primes, or a function of letters (``f(x)``, ``f^{-1}(x)``).
_NAME = re.compile(
    r"(?:[A-Za-z]|\\[A-Za-z]+)(?:_\s*(?:\{[A-Za-z0-9,\\ ]+\}|[A-Za-z0-9]))?'*"
    r"(?:\^\s*\{-1\})?'*(?:\s*\(\s*[A-Za-z](?:\s*,\s*[A-Za-z])*\s*\))?"
)
# A numeric left side (``2^{10} = 1024``): digits and arithmetic only.
_ARITHMETIC = re.compile(r"(?:[\d\s.+\-*/^(){}]|\\(?:[dt]?frac|sqrt|cdot|times|div)(?![A-Za-z]))+")
_RELATION = re.compile(r"[<>]|\\(?:[lg]eq?|neq?|in|approx|sim)(?![A-Za-z])")
_ONE_CHAR_SCRIPT = re.compile(r"([_^])\{\s*([A-Za-z0-9])\s*\}")
# A system of equations: "\\begin{cases}..\\end{cases}", "\\{\\begin{array}{l}..\\end{array}."
# (``\\left``/``\\right`` already dropped), or bare rows "x=2 \\\\ y=1"; read as a list.
_SYSTEM = re.compile(
    r"\s*(?:\\begin\{cases\}(.*)\\end\{cases\}"
    r"|\\\{\s*\\begin\{array\}(?:\{[^{}]*\})?(.*)\\end\{array\}\s*\.?)\s*",
    re.DOTALL,
)
# "t(0,4]", "x[1,2]": a variable written before an interval or a union of intervals.
_INTERVAL = r"[\[(][^\[\]()]*,[^\[\]()]*[\])]"
_NAMED_INTERVAL = re.compile(rf"\s*[A-Za-z]\s*({_INTERVAL}(?:\s*\\cup\s*{_INTERVAL})*)\s*")
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
    """Trailing ``.``, ``,``, ``;`` (not ``...``) and stray trailing backslashes dropped."""
    text = text.strip()
    while text and (
        text[-1] == "\\"
        or (text[-1] in ".,;" and not text.endswith("...") and not text.endswith("\\."))
    ):
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
    """Drop trailing ``\\text{...}`` unit groups, plain words after a number (``7 square
    meters``) and a unit glued to a number (``12days``)."""
    head = _UNIT_TAIL.sub("", text).strip()
    if head and head != text and head[-1] in "0123456789})":
        text = head
    head = _PLAIN_UNIT_TAIL.sub("", text).strip()
    if head and head != text and _is_number(head):
        text = head
    glued = _GLUED_UNIT.fullmatch(text)
    return glued.group(1) if glued else text


def _system_as_list(text: str) -> str:
    """A system of equations written in rows, as the list of its equations."""
    system = _SYSTEM.fullmatch(text)
    if system:
        rows = (system.group(1) or system.group(2)).split("\\\\")
    elif "\\\\" in text and "\\begin" not in text:
        rows = text.split("\\\\")
        if not all("=" in row for row in rows):
            return text
    else:
        return text
    rows = [row.replace("&", " ").strip() for row in rows]
    return ", ".join(row for row in rows if row)


def canonical(text: str) -> str:
    """``text`` with layout-only differences removed: spacing commands, ``\\left``/
    ``\\right``, ``\\dfrac``, ``^{\\circ}``, trailing punctuation, trailing units, and
    scientific notation written out as a decimal; thousands separators (``,\\!``, ``{,}``)
    dropped, a ``$125$ miles`` label read as its math, one-character sub- and superscripts
    unbraced (``x_{1}`` is ``x_1``) and a ``cases`` system written as the list of its rows."""
    return _canonical_and_unit(text)[0]


def _canonical_and_unit(text: str) -> tuple[str, str]:
    """``canonical(text)`` and the trailing unit it dropped (``""`` when none)."""
    words = _MATH_THEN_WORDS.fullmatch(text.strip())
    if words:
        text = words.group(1)
    text = _THOUSANDS.sub("", text)
    text = _SPACING.sub(lambda m: m.group() if m.group() == "\\\\" else " ", text)
    text = _LEFT_RIGHT.sub("", text)
    text = _SMALL_FRAC.sub("\\\\frac", text)
    text = _DEGREE.sub("^\\\\circ", text)
    text = _ONE_CHAR_SCRIPT.sub(r"\1\2", text)
    text = _system_as_list(text)
    text = _strip_punctuation(text)
    head = _strip_units(text)
    unit = text[len(head) :] if text.startswith(head) else ""
    return _scientific_to_decimal(_strip_punctuation(head)), unit


# Spellings of common units, so that a label's unit and an answer's can be told apart:
# "12days" does not accept "12 \\text{ hours}" (math-verify drops both units and would).
_UNIT_SPELLINGS = {
    "second": "s sec secs second seconds",
    "minute": "min mins minute minutes",
    "hour": "h hr hrs hour hours",
    "day": "d day days",
    "week": "week weeks",
    "month": "month months",
    "year": "yr yrs year years",
    "mm": "mm millimeter millimeters millimetre millimetres",
    "cm": "cm centimeter centimeters centimetre centimetres",
    "m": "m meter meters metre metres",
    "km": "km kilometer kilometers kilometre kilometres",
    "m^2": "m^2 sqm squaremeter squaremeters squaremetre squaremetres",
    "cm^2": "cm^2 sqcm squarecentimeter squarecentimeters",
    "ft^2": "ft^2 sqft squarefoot squarefeet",
    "m^3": "m^3 cubicmeter cubicmeters cubicmetre cubicmetres",
    "cm^3": "cm^3 cc cubiccentimeter cubiccentimeters cubiccentimetre cubiccentimetres",
    "inch": "in inch inches",
    "ft": "ft foot feet",
    "mile": "mi mile miles",
    "g": "g gram grams",
    "kg": "kg kilogram kilograms",
    "dollar": "dollar dollars",
    "cent": "cent cents",
}
_UNIT_NAMES = {word: name for name, words in _UNIT_SPELLINGS.items() for word in words.split()}
_UNIT_NOISE = re.compile(r"\\(?:text|textnormal|mbox|mathrm|textrm|rm)|[{}\s\\]")


KNOWN_UNITS = frozenset(_UNIT_SPELLINGS)


def unit_name(text: str) -> str | None:
    """The unit an answer ends with (``None``: none): its name in the table (``12days`` and
    ``12 \\text{ day}`` give ``day``, one of ``KNOWN_UNITS``), else its spelling without
    wrappers, spaces and case."""
    unit = _UNIT_NOISE.sub("", _canonical_and_unit(text)[1]).lower()
    return _UNIT_NAMES.get(unit, unit) or None


def other_unit(label_units: frozenset[str], answer: str) -> bool:
    """Whether ``answer`` carries another unit than the label's (each of the label's
    answers has one): different names, at least one of them known to the table, so that
    two unknown spellings of one unit are not told apart."""
    if not label_units:
        return False
    unit = unit_name(answer)
    if unit is None or unit in label_units:
        return False
    return unit in KNOWN_UNITS or bool(label_units & KNOWN_UNITS)


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


def _top_level(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside braces, brackets and parentheses."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
        elif c == sep and depth == 0 and not (sep == "=" and i and text[i - 1] in "<>!\\"):
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def value_forms(form: str) -> list[str]:
    """What a (canonical) label also accepts alone when the answer is not an equation: the
    value of ``name = value`` or of a chain ``a = b = 0``, when every left side is a bare name
    (``y``, ``X_{d}``, ``\\lambda``, ``f(x)``) or arithmetic (``2^{10} = 1024``), and the
    interval of ``t(0,4]``. After an arithmetic side the value must be arithmetic too: the
    label then states a computation's result, so ``7 = 11a+c`` does not make ``11a+c``
    (the expression the computation equals) an answer."""
    interval = _NAMED_INTERVAL.fullmatch(form)
    if interval and ("[" in form or "]" in form):  # "P(0,4)" is a point, "f(1,2)" a value
        return [interval.group(1)]
    if len(_top_level(form, ",")) > 1:
        return []  # a list of assignments is math-verify's to match
    *sides, value = (side.strip() for side in _top_level(form, "="))
    if not sides or not value or _RELATION.search(form):
        return []
    arithmetic = [side for side in sides if not _NAME.fullmatch(side)]
    if not all(_ARITHMETIC.fullmatch(side) for side in arithmetic):
        return []
    if arithmetic and not _ARITHMETIC.fullmatch(value):
        return []
    return [canonical(value)]


def gold_parts(label: object) -> tuple[list[str], list[str], list[str]]:
    """``(math_forms, value_forms, text_forms)`` of a label: canonical alternatives
    math-verify grades, the values some of them also accept alone (``value_forms``; never
    against an answer that is itself an equation: ``x = 5`` does not accept ``y = 5``), and
    alternatives that are really text (also compared as text). A ``1000,99`` label also
    accepts its decimal-comma reading ``1000.99``."""
    math_forms: list[str] = []
    values: list[str] = []
    text_forms: list[str] = []
    for answer in decode_alternatives(label):
        form = canonical(answer)
        if not form:
            continue
        if is_text_label(form):
            text_forms.append(form)
            continue
        math_forms.append(form)
        values += value_forms(form)
        dotted = decimal_comma(form)
        if dotted:
            math_forms.append(dotted)
    math_forms = list(dict.fromkeys(math_forms))
    values = [v for v in dict.fromkeys(values) if v and v not in math_forms]
    return math_forms, values, list(dict.fromkeys(text_forms))


def gold_forms(label: object) -> tuple[list[str], list[str]]:
    """``(math_forms, text_forms)`` of ``gold_parts``, the values among the math forms."""
    math_forms, values, text_forms = gold_parts(label)
    return math_forms + values, text_forms
