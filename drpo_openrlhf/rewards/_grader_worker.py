"""Child process of :mod:`drpo_openrlhf.rewards.grader_pool`: grades answers with math-verify.

Run by path (``python _grader_worker.py FD MEMORY_MB PARENT_PID``), not as a package module, so that
it imports nothing but the standard library and math-verify. It talks to its parent over
the inherited socket ``FD`` with :class:`multiprocessing.connection.Connection` messages:

* child -> parent, once: ``("ready", pid)`` or ``("fatal", message)``;
* parent -> child: ``("grade", job_id, gold, pred, soft_timeout_s)`` or ``("stop",)``:
  ``gold`` is ``(golds, plain_golds)``, the label's acceptable answers normalised and as
  written; ``pred`` is ``(readings, parts)``, the prediction's normalised readings (each a
  tuple of box contents) and its boxes as written. A bare string stands for all of these
  (tests and the benchmark send ``("2", "2.0")``);
* child -> parent: ``("result", job_id, correct, reason, restart)``.

The child runs in its own main thread, so a ``SIGALRM`` interval timer (soft deadline)
can interrupt pure-Python sympy work and answer ``"timeout"`` without losing the process.
Work stuck inside C code ignores the signal; the parent then kills the process at its
hard deadline and starts a new one. The child exits when the parent goes away (EOF).
"""

from __future__ import annotations

import os
import sys

# Running by path puts this package directory first on sys.path; drop it so that its
# modules can never shadow standard or third-party ones.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

import logging
import math
import re
import resource
import signal
import warnings
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection

_GOLD_CACHE_SIZE = 4096
_DIGITS = 6
"""Float rounding (decimals) math-verify uses for labels of magnitude about 1; smaller
labels get more decimals so that the comparison stays relative (8.2e-19 != 8.2e-21)."""
_COMMAND = re.compile(r"\\[A-Za-z]+")
_LETTER = re.compile(r"[A-Za-z]")
_MISSING = object()
# Graded once at start-up: sympy imports much of itself lazily, and the first answer of
# each kind (interval, matrix, equation...) would otherwise pay for it inside its deadline.
_WARMUP = (
    ("\\frac{1}{2}", "0.5"),
    ("(1, 2]", "[1,2)"),
    ("\\{1, 2\\}", "\\{2,1\\}"),
    ("x^2 + 2x + 1", "(x+1)^2"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("3 + 4i", "4i+3"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\3\\end{pmatrix}"),
    ("y = 2x + 1", "2x+1"),
    ("x \\in (-\\infty, 3)", "x < 3"),
    ("10\\%", "0.1"),
    ("\\text{(A)}", "A"),
    ("\\frac{\\pi}{2}", "90^\\circ"),
)


class _Deadline(BaseException):
    """Raised by the soft timer. A BaseException, so that math-verify's and sympy's
    ``except Exception`` blocks do not swallow it."""


_armed = False


def _on_alarm(signum, frame):
    if _armed:
        raise _Deadline


def _limit_memory(memory_mb: int) -> None:
    if memory_mb <= 0:
        return
    limit = memory_mb * 1024 * 1024
    try:
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ValueError, OSError):
        pass


class _Grader:
    def __init__(self):
        from math_verify import parse, verify

        self._parse = parse
        self._verify = verify
        self._gold_cache: OrderedDict[str, list] = OrderedDict()

    def _parse_boxed(self, latex: str) -> list:
        return self._parse("\\boxed{" + latex + "}", parsing_timeout=None)

    def _cached(self, key: str, make: Callable[[], object]):
        """``make()``, kept for ``key`` in a bounded LRU: a group's responses share a label."""
        entry = self._gold_cache.get(key, _MISSING)
        if entry is _MISSING:
            entry = make()
            self._gold_cache[key] = entry
            if len(self._gold_cache) > _GOLD_CACHE_SIZE:
                self._gold_cache.popitem(last=False)
        else:
            self._gold_cache.move_to_end(key)
        return entry

    def _gold(self, gold: str) -> tuple[list, int, bool]:
        """The parsed label, its float rounding, and whether the parse is faithful (a label
        with letters must not become a bare number)."""

        def make() -> tuple[list, int, bool]:
            parsed = self._parse_boxed(gold)
            return parsed, _float_rounding(parsed), _faithful(gold, parsed)

        return self._cached(gold, make)

    def _parse_parts(self, parts: tuple[str, ...]) -> list:
        """The boxes of one answer parsed as math-verify parses ``\\boxed{a}, \\boxed{b}``:
        one box as itself, several as the set of their values (sets flattened)."""
        if len(parts) == 1:
            return self._parse_boxed(parts[0])
        from sympy import FiniteSet

        values = []
        for part in parts:
            parsed = self._parse_boxed(part)
            if not parsed or isinstance(parsed[0], str):
                return []
            value = parsed[0]
            values.extend(value.args if isinstance(value, FiniteSet) else [value])
        return [FiniteSet(*values), ", ".join(parts)]

    def grade(self, gold: tuple | str, pred: tuple | str) -> tuple[bool, str]:
        """Correct if the prediction matches any acceptable answer, by the project's rules
        or by plain math-verify (barring two vetoes); otherwise the most telling reason."""
        golds, plain_golds = ((gold,), (gold,)) if isinstance(gold, str) else gold
        readings, parts = (((pred,),), (pred,)) if isinstance(pred, str) else pred
        parsed_readings: dict[tuple[str, ...], list] = {}
        verified: set[tuple[str, tuple[str, ...]]] = set()
        usable = unfaithful = pred_usable = precise = False
        for form in golds:
            gold_parsed, rounding, faithful = self._gold(form)
            if not gold_parsed:
                continue
            if not faithful:
                unfaithful = True
                continue
            usable = True
            precise = precise or rounding > _DIGITS
            for reading in readings:
                if reading not in parsed_readings:
                    parsed_readings[reading] = self._parse_parts(reading)
                pred_parsed = parsed_readings[reading]
                if not pred_parsed:
                    continue
                pred_usable = True
                if rounding == _DIGITS:
                    verified.add((form, reading))
                if self._verify(
                    gold_parsed, pred_parsed, float_rounding=rounding, timeout_seconds=None
                ):
                    return True, "ok"
        if usable:
            reason = "wrong" if pred_usable else "unparsable"
        else:
            reason = "text_mismatch" if unfaithful else "bad_label"
        plain = self._plain(plain_golds, parts, verified, precise)
        if plain == "ok":
            return True, "ok"
        return False, plain or reason

    def _plain(
        self,
        plain_golds: tuple[str, ...],
        parts: tuple[str, ...],
        verified: set[tuple[str, tuple[str, ...]]],
        precise: bool,
    ) -> str | None:
        """Plain math-verify on the label and boxes as written (``verify(parse(gold),
        parse(pred))``, default rounding): ``"ok"``, a veto's reason, or ``None``.

        Vetoes (documented in docs/rewards.md): when the label is one number below 0.1 in
        magnitude (``precise``: the comparison above was at six significant digits), a
        number that failed it is wrong whatever six decimals say; and a label with letters
        that math-verify reads as a bare number (``3 \\text{ apples and } 2 \\text{ pears}``
        as ``3``) is not trusted."""
        pred_parsed = None
        veto = None
        for form in plain_golds:
            if (form, parts) in verified:
                continue  # the same comparison already failed above
            gold_parsed = self._plain_gold(form)
            if not gold_parsed:
                continue
            if pred_parsed is None:
                pred_parsed = self._parse_parts(parts)
                if not pred_parsed:
                    return None
            if not self._verify(gold_parsed, pred_parsed, timeout_seconds=None):
                continue
            if precise and _is_number(pred_parsed):
                veto = "wrong"
            elif not _faithful(form, gold_parsed):
                veto = veto or "text_mismatch"
            else:
                return "ok"
        return veto

    def _plain_gold(self, gold: str) -> list:
        """A label as written, parsed (cached beside the normalised forms)."""
        return self._cached("\0plain\0" + gold, lambda: self._parse_boxed(gold))


def _float_rounding(parsed: list) -> int:
    """Decimals for math-verify's float comparison: about six significant digits."""
    try:
        from sympy import Number

        value = parsed[0] if parsed else None
        if isinstance(value, Number) and value != 0:
            magnitude = math.floor(math.log10(abs(float(value))))
            return max(_DIGITS, _DIGITS - 1 - magnitude)
    except (TypeError, ValueError, OverflowError):
        pass
    return _DIGITS


def _is_number(parsed: list) -> bool:
    """Whether math-verify read one numeric value (``8.2/10**21`` included)."""
    return bool(parsed) and bool(getattr(parsed[0], "is_number", False))


def _faithful(gold: str, parsed: list) -> bool:
    """False when math-verify reduced a label with letters (words, named quantities) to a
    bare number: grading against that number would accept unrelated answers."""
    from sympy import Number

    if not parsed or not isinstance(parsed[0], Number):
        return True
    return not _LETTER.search(_COMMAND.sub(" ", gold))


def _serve(conn: Connection, grader: _Grader) -> int:
    global _armed
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0
        if not msg or msg[0] != "grade":
            return 0
        _, job_id, gold, pred, soft_timeout_s = msg
        correct, reason, restart = False, "error", False
        try:
            try:
                _armed = True
                signal.setitimer(signal.ITIMER_REAL, max(float(soft_timeout_s), 1e-3))
                correct, reason = grader.grade(gold, pred)
            finally:
                _armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Deadline:
            correct, reason = False, "timeout"
        except MemoryError:
            correct, reason, restart = False, "error", True
        except Exception:
            correct, reason = False, "error"
        try:
            conn.send(("result", job_id, correct, reason, restart))
        except (EOFError, OSError):
            return 0
        if restart:
            return 0


def _die_with_parent(parent_pid: int) -> None:
    """Linux: get SIGKILL when the parent goes away, even if stuck in C code then."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid and os.getppid() != parent_pid:
        os._exit(0)  # the parent died before prctl took effect


def main(argv: list[str]) -> int:
    fd = int(argv[1])
    memory_mb = int(argv[2]) if len(argv) > 2 else 0
    _die_with_parent(int(argv[3]) if len(argv) > 3 else 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent
    signal.signal(signal.SIGALRM, _on_alarm)
    conn = Connection(fd)
    try:
        grader = _Grader()
        logging.disable(logging.CRITICAL)  # math-verify warns on every failed parse
        warnings.simplefilter("ignore")  # and sympy on deprecated input
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - library prints must not leak
        for gold, pred in _WARMUP:
            grader.grade(gold, pred)
        grader._gold_cache.clear()
    except BaseException as exc:
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return 1
    _limit_memory(memory_mb)
    conn.send(("ready", os.getpid()))
    return _serve(conn, grader)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
