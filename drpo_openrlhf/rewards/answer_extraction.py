"""Cheap, linear-time text handling shared by the reward functions.

Everything here runs in the caller's thread (no sympy, no regex backtracking), so it is
safe on megabytes of text: cutting the response out of an OpenRLHF query, splitting off
the answer after ``</think>``, and finding the last ``\\boxed{...}`` / ``\\fbox{...}``.
"""

from __future__ import annotations

import re

THINK_END = "</think>"
_BOX_COMMANDS = ("\\boxed", "\\fbox")
# When the prompt is not an exact prefix of the query, its end is located by a tail of
# the prompt ("anchor"), longest first; see ``split_query``.
_ANCHOR_SIZES = (64, 32, 16)
_MAX_ANCHOR_HITS = 1000


def to_text(value: object) -> str | None:
    """``value`` as a ``str``: bytes are decoded (UTF-8, replacing errors), numbers are
    formatted, ``None`` (and anything unprintable) gives ``None``."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, (bool, int, float)):
        return str(value)
    try:
        return str(value)
    except Exception:
        return None


def split_query(query: str, prompt: str | None) -> tuple[str, bool]:
    """Cut the response out of an OpenRLHF ``query``; returns ``(response, prompt_found)``.

    OpenRLHF 0.11.2 (``SingleTurnAgentExecutor.execute``) passes
    ``tokenizer.decode(prompt_ids + response_ids, skip_special_tokens=False)`` as the query,
    where ``prompt_ids`` is the tokenized prompt string (possibly left-truncated). Usually
    the prompt is an exact prefix. If it is not (decode normalisation, truncation), the
    response starts after the occurrence of the prompt's last 64 (or 32, or 16)
    characters that ends closest to ``len(prompt)``; failing that, the whole query is
    returned with ``prompt_found=False``.
    """
    if prompt is None:
        return query, False
    if not prompt:
        return query, True
    if query.startswith(prompt):
        return query[len(prompt) :], True
    expected_end = len(prompt)
    for size in _ANCHOR_SIZES:
        anchor = prompt[-size:]
        if len(anchor) < size and size != _ANCHOR_SIZES[-1]:
            continue  # the prompt is shorter than this anchor: try a shorter one
        best = -1
        pos = query.find(anchor)
        for _ in range(_MAX_ANCHOR_HITS):
            if pos == -1:
                break
            end = pos + len(anchor)
            if best == -1 or abs(end - expected_end) < abs(best - expected_end):
                best = end
            pos = query.find(anchor, pos + 1)
        if best != -1:
            return query[best:], True
    return query, False


def answer_part(response: str, require_think_end: bool = True) -> str | None:
    """The text after the first ``</think>``; ``None`` when it is missing and required.

    With ``require_think_end=False`` (non-thinking models) a response without
    ``</think>`` is answered by its whole text.
    """
    head, sep, tail = response.partition(THINK_END)
    if sep:
        return tail
    return None if require_think_end else head


def _braced(text: str, open_pos: int, limit: int) -> int:
    """Index just past the ``}`` closing the ``{`` at ``open_pos`` (searching before
    ``limit``); -1 if unbalanced. ``\\{`` and ``\\}`` are literal braces in LaTeX."""
    depth = 0
    i = open_pos
    n = limit
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


_UNCLOSED = object()


def _box_argument(text: str, cmd_end: int, limit: int) -> tuple[object, int]:
    """The argument of a box command ending at ``cmd_end`` (within ``text[:limit]``) and
    the index just past it: a ``str``, ``None`` if malformed, or ``_UNCLOSED`` if its
    ``{`` is never closed."""
    n = limit
    i = cmd_end
    if i < n and (text[i].isalpha() or text[i] == "@"):
        return None, i  # a longer control word, e.g. \boxedsomething
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None, i
    if text[i] == "{":
        end = _braced(text, i, n)
        return (_UNCLOSED, i) if end == -1 else (text[i + 1 : end - 1], end)
    if i == cmd_end:
        return None, i  # "\boxed5" is not a box; "\boxed 5" is
    # "\boxed 5": like the DeepScaleR / DRPO extraction, take the rest of the line up to
    # the closing math delimiter.
    stop = n
    for delim in ("$", "\n", "\\]", "\\)"):
        j = text.find(delim, i, n)
        if j != -1 and j < stop:
            stop = j
    return text[i:stop].strip().rstrip(".,;"), stop


def _last_box(text: str, end: int) -> tuple[int, int, str] | None:
    """``(start, stop, content)`` of the last well-formed box in ``text[:end]``.

    Linear time: a box that does not close before a later unclosed box cannot close
    after it either, so earlier boxes are only scanned up to that one.
    """
    # last occurrence of each command; only the one just consumed is searched again, so
    # the searches together cover the text once
    found = {cmd: text.rfind(cmd, 0, end) for cmd in _BOX_COMMANDS}
    while True:
        cmd = max(found, key=found.__getitem__)
        pos = found[cmd]
        if pos == -1:
            return None
        content, stop = _box_argument(text, pos + len(cmd), end)
        if isinstance(content, str):
            return pos, stop, content
        if content is _UNCLOSED:
            end = pos
        found[cmd] = text.rfind(cmd, 0, pos)


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed ``\\boxed{...}`` / ``\\boxed x`` / ``\\fbox{...}``.

    Nested braces are handled; an unclosed box (e.g. a truncated answer) is skipped in
    favour of an earlier well-formed one. Returns ``None`` when there is none.
    """
    box = _last_box(text, len(text))
    return None if box is None else box[2]


MAX_FINAL_BOXES = 16
"""At most this many chained boxes form the final answer (keeps the scan bounded)."""
_MAX_GAP = 40
# What may stand between two boxes of one final answer: spacing, math delimiters, commas,
# semicolons, "and"/"or" (bare or in \text{}), as in "\boxed{(2, 2)} and \boxed{(6, 2)}" or
# "$\boxed{k=45} \quad \text{and} \quad \boxed{n=2}$".
_GAP = re.compile(
    r"(?:\s|\$|\\[()\[\]]|\\\\|\\[,;:! ]|\\q?quad(?![A-Za-z])|[,;&~]"
    r"|\\(?:text|mbox|textrm|mathrm)\s*\{\s*,?\s*(?:and|or)?\s*\}|(?<![A-Za-z])(?:and|or)(?![A-Za-z]))*"
)


# math-verify's own rule for boxes of one answer (``extract_boxed_content``): any gap under
# 10 characters, or under 70 holding "and", "or", a comma or a semicolon between different
# contents ("there are \\boxed{1} apples and \\boxed{2} pears").
_LOOSE_SHORT_GAP = 10
_LOOSE_MAX_GAP = 70
_LOOSE_SEPARATOR = re.compile(r"\b(?:and|or)\b|[,;]")


def _chained(
    text: str, gap_start: int, gap_end: int, content: str, later: str, loose: bool
) -> bool:
    """Whether a box ending at ``gap_start`` belongs to the same answer as the box starting
    at ``gap_end`` (``content`` and ``later`` are their contents)."""
    gap = gap_end - gap_start
    if not loose:
        return gap <= _MAX_GAP and bool(_GAP.fullmatch(text, gap_start, gap_end))
    if gap < _LOOSE_SHORT_GAP:
        return True
    return (
        gap < _LOOSE_MAX_GAP
        and content.strip() != later.strip()
        and bool(_LOOSE_SEPARATOR.search(text, gap_start, gap_end))
    )


def final_boxes(text: str, loose: bool = False) -> list[str] | None:
    """The boxed answers of the final answer, in order: the last well-formed box and the
    boxes chained right before it (separated only by what ``_GAP`` allows; with ``loose``,
    by math-verify's wider rule, words included); ``None`` when there is no box. A
    multi-part answer is often written one box per part."""
    box = _last_box(text, len(text))
    if box is None:
        return None
    start, _, content = box
    parts = [content]
    while len(parts) < MAX_FINAL_BOXES:
        previous = _last_box(text, start)
        if previous is None or not _chained(text, previous[1], start, previous[2], content, loose):
            break
        start, _, content = previous
        parts.append(content)
    return parts[::-1]


_MATH_DELIMS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def normalize_label(label: object) -> str | None:
    """The gold answer as bare LaTeX: boxed labels are unboxed, ``$...$`` is stripped. A
    label holding several boxes of one answer (``\\boxed{1}\\boxed{2}``, ``\\boxed{1} apples
    and \\boxed{2} pears``, as math-verify groups them) is the list of their contents.

    Returns ``None`` for a missing or empty label.
    """
    text = to_text(label)
    if text is None:
        return None
    text = text.strip()
    if "\\boxed" in text or "\\fbox" in text:
        boxes = final_boxes(text, loose=True)
        if boxes is not None:
            text = ", ".join(dict.fromkeys(b.strip() for b in boxes if b.strip()))
    for left, right in _MATH_DELIMS:
        if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : len(text) - len(right)].strip()
            break
    return text or None
