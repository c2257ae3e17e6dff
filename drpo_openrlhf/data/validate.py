"""Validation of converted rows: every problem found becomes an Issue naming file and row.

Rows that cannot be used (unparsable JSON, not an object, missing/empty/wrongly-typed problem
or answer, malformed K&K solution) are always dropped. Duplicated problems and answers that
math-verify cannot parse are kept unless the caller asks to drop them: both may be legitimate
(a repeated problem, a textual answer) and dropping them silently would change the data.
Puzzle sizes outside the chosen K&K range are counted as excluded, not as issues.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from tqdm import tqdm

from drpo_openrlhf.data.convert import Converted, Excluded, RowError
from drpo_openrlhf.data.readers import RawRow, SourceError
from drpo_openrlhf.data.sources import Source
from drpo_openrlhf.rewards.label_forms import gold_forms


@dataclass(frozen=True)
class Issue:
    """One problem with one row; ``dropped`` says whether the row left the output."""

    source: str
    location: str
    kind: str
    message: str
    dropped: bool

    def __str__(self) -> str:
        action = "dropped" if self.dropped else "kept"
        return f"{self.location}: {self.kind}: {self.message} [{action}]"


@dataclass
class Prepared:
    """What became of one source's rows."""

    source: str
    rows: list[Converted] = field(default_factory=list)
    locations: list[str] = field(default_factory=list)
    issues: list[Issue] = field(default_factory=list)
    excluded: Counter[str] = field(default_factory=Counter)
    read: int = 0
    list_labels: int = 0

    def add_issue(self, location: str, kind: str, message: str, dropped: bool) -> None:
        self.issues.append(Issue(self.source, location, kind, message, dropped))


def problem_key(problem: str) -> str:
    """Duplicate key: the problem with runs of whitespace collapsed."""
    return " ".join(problem.split())


def answer_parses(label: str, cache: dict[str, bool]) -> bool:
    """Whether the reward can grade ``label``: some acceptable answer of it is graded as
    text (see ``label_forms.is_text_label``) or math-verify extracts a mathematical object
    from its normalised ``\\boxed{...}`` form.

    A result holding only strings is math-verify's fallback for text it could not interpret,
    so it counts as a failure. ``parse`` bounds its time with SIGALRM, which only works in the
    main thread; that is where the CLI calls it.
    """
    if label not in cache:
        from math_verify import parse

        math_forms, text_forms = gold_forms(label)
        cache[label] = bool(text_forms) or any(
            any(not isinstance(item, str) for item in parse(f"\\boxed{{{form}}}"))
            for form in math_forms
        )
    return cache[label]


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def prepare(
    source: Source,
    rows: Iterable[RawRow],
    *,
    drop_duplicates: bool,
    drop_unparsable: bool,
    progress: bool | None = None,
) -> Prepared:
    """Convert and validate ``rows`` in order; ``progress=None`` shows a bar on terminals."""
    result = Prepared(source.name)
    first_seen: dict[str, tuple[str, str]] = {}
    parse_cache: dict[str, bool] = {}
    disable = None if progress is None else not progress
    for raw in tqdm(rows, desc=source.name, unit="row", disable=disable):
        result.read += 1
        if raw.error is not None:
            result.add_issue(raw.location, "invalid_json", raw.error, dropped=True)
            continue
        if not isinstance(raw.record, dict):
            kind = "null" if raw.record is None else type(raw.record).__name__
            result.add_issue(raw.location, "wrong_type", f"row is {kind}, expected an object", True)
            continue
        try:
            row = source.convert(raw.record)
        except RowError as err:
            result.add_issue(raw.location, err.kind, err.message, dropped=True)
            continue
        except Excluded as err:
            result.excluded[str(err)] += 1
            continue
        key = problem_key(row.problem)
        if key in first_seen:
            where, label = first_seen[key]
            detail = "" if label == row.label else f" with a different answer ({_short(label)})"
            message = f"same problem as {where}{detail}"
            result.add_issue(raw.location, "duplicate", message, dropped=drop_duplicates)
            if drop_duplicates:
                continue
        if source.math and not answer_parses(row.label, parse_cache):
            message = f"math-verify cannot parse answer {_short(row.label)}"
            result.add_issue(raw.location, "unparsable_answer", message, dropped=drop_unparsable)
            if drop_unparsable:
                continue
        first_seen.setdefault(key, (raw.location, row.label))  # first *kept* copy
        result.rows.append(row)
        result.locations.append(raw.location)
        result.list_labels += row.alternatives > 1
    _check_layout(result)
    return result


def _check_layout(result: Prepared) -> None:
    """A file none of whose rows has a known layout is an error, not a pile of drops."""
    if result.rows or result.excluded or not result.issues:
        return
    if all(issue.kind == "missing" for issue in result.issues):
        first = result.issues[0]
        raise SourceError(
            f"{result.source}: no row has a layout drpo-data knows ({result.read} rows read); "
            f"{first.location}: {first.message}"
        )


def flag_cross_source_duplicates(prepared: list[Prepared]) -> None:
    """Warn about problems kept in more than one output.

    OpenRLHF maps each evaluation prompt to one ``datasource``, so a problem in two evaluation
    files is scored under only one of them; in a training and an evaluation file it is
    contamination. The rows stay: which copy to remove is the user's decision.
    """
    owner: dict[str, tuple[str, str]] = {}
    for result in prepared:
        for row, location in zip(result.rows, result.locations, strict=True):
            key = problem_key(row.problem)
            if key in owner and owner[key][0] != result.source:
                other, where = owner[key]
                message = f"same problem as {where} (kept in {other})"
                result.add_issue(location, "cross_source_duplicate", message, dropped=False)
            else:
                owner.setdefault(key, (result.source, location))
