"""Each validation error is reported with its file and row, and dropped or kept as documented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drpo_openrlhf.data.convert import Converted
from drpo_openrlhf.data.readers import read_local
from drpo_openrlhf.data.sources import build_sources
from drpo_openrlhf.data.validate import (
    Prepared,
    answer_parses,
    flag_cross_source_duplicates,
    prepare,
)

FIXTURES = Path(__file__).parent / "fixtures" / "data"
BAD = FIXTURES / "bad"
SOURCES = build_sources(range(3, 8), range(2, 9))

# line of bad/math_rows.jsonl -> (kind, dropped by default, text the message must contain)
EXPECTED_MATH_ISSUES = {
    2: ("missing", True, "problem is missing (looked for 'problem', 'question'"),
    3: ("empty", True, "problem field 'problem' is empty"),
    4: ("wrong_type", True, "problem field 'problem' is int, expected a string"),
    5: ("missing", True, "answer is missing"),
    6: ("wrong_type", True, "answer field 'answer' is dict"),
    7: ("invalid_json", True, "invalid JSON"),
    8: ("wrong_type", True, "row is list, expected an object"),
    9: ("duplicate", False, "same problem as {path} line 1"),
    10: ("duplicate", False, "same problem as {path} line 1 with a different answer ('4')"),
    11: ("unparsable_answer", False, "math-verify cannot parse answer '\\\\frac{'"),
    12: ("wrong_type", True, "answer field 'answer' is bool"),
    14: ("empty", True, "answer field 'answer' is empty"),
}


def _prepare(name: str, path: Path, **options) -> Prepared:
    flags = {"drop_duplicates": False, "drop_unparsable": False, "progress": False} | options
    return prepare(SOURCES[name], read_local(path), **flags)


def test_every_math_issue_names_file_and_line():
    path = BAD / "math_rows.jsonl"
    result = _prepare("deepscaler", path)
    found = {int(issue.location.rsplit(" ", 1)[1]): issue for issue in result.issues}
    assert set(found) == set(EXPECTED_MATH_ISSUES)
    for line, (kind, dropped, text) in EXPECTED_MATH_ISSUES.items():
        issue = found[line]
        assert issue.location == f"{path} line {line}"
        assert (issue.kind, issue.dropped) == (kind, dropped), line
        assert text.replace("{path}", str(path)) in issue.message, (line, issue.message)
        assert str(issue).startswith(f"{path} line {line}: {kind}: ")
        assert str(issue).endswith("[dropped]" if dropped else "[kept]")
    assert result.read == 13
    assert [row.label for row in result.rows] == ["4", "4", "5", "\\frac{"]
    assert result.locations == [f"{path} line {n}" for n in (1, 9, 10, 11)]


def test_duplicates_and_unparsable_answers_are_dropped_on_request():
    path = BAD / "math_rows.jsonl"
    result = _prepare("deepscaler", path, drop_duplicates=True, drop_unparsable=True)
    assert result.locations == [f"{path} line 1"]
    dropped = {issue.kind for issue in result.issues if issue.dropped}
    assert {"duplicate", "unparsable_answer"} <= dropped
    assert not [issue for issue in result.issues if not issue.dropped]


def test_gsm8k_rows_without_marker_or_with_a_list_answer_are_dropped():
    path = BAD / "gsm8k_rows.jsonl"
    result = _prepare("gsm8k", path)
    assert [(i.location, i.kind) for i in result.issues] == [
        (f"{path} line 1", "bad_format"),
        (f"{path} line 2", "wrong_type"),
    ]
    assert [row.label for row in result.rows] == ["20"]


def test_kk_issues_name_rows_and_sizes_are_excluded_not_reported(tmp_path):
    path = BAD / "kk_rows.jsonl"
    result = _prepare("kk-test", path)
    assert [i.location for i in result.issues] == [f"{path} line {n}" for n in range(1, 7)]
    assert all(i.dropped for i in result.issues) and not result.rows

    train = _prepare("kk-train", FIXTURES / "kk" / "train")
    assert train.issues == []  # K&K labels are not math: no math-verify warnings
    assert dict(train.excluded) == {"2-person puzzle outside 3-7": 1}
    assert (train.read, len(train.rows)) == (3, 2)


def test_clean_fixtures_have_no_issue():
    result = _prepare("olympiadbench", FIXTURES / "olympiadbench.jsonl")
    assert result.issues == [] and len(result.rows) == result.read == 3


def test_answer_parses_rejects_string_only_fallback_and_caches():
    cache: dict[str, bool] = {}
    assert answer_parses("\\frac{3}{4}", cache)
    assert answer_parses("3, 5", cache)
    assert not answer_parses("}", cache)
    assert not answer_parses("\\frac{", cache)
    assert cache == {"\\frac{3}{4}": True, "3, 5": True, "}": False, "\\frac{": False}


def _prepared(source: str, problems: list[str]) -> Prepared:
    result = Prepared(source)
    for i, problem in enumerate(problems, start=1):
        result.rows.append(Converted(problem, problem, "1", source))
        result.locations.append(f"{source}.jsonl line {i}")
    return result


def test_cross_source_duplicates_are_flagged_on_the_later_source_and_kept():
    first = _prepared("deepscaler", ["What is 1?", "What is 2?"])
    second = _prepared("math500", ["What is 3?", "What  is 2?"])
    flag_cross_source_duplicates([first, second])
    assert first.issues == []
    (issue,) = second.issues
    assert (issue.location, issue.kind, issue.dropped) == (
        "math500.jsonl line 2",
        "cross_source_duplicate",
        False,
    )
    assert "same problem as deepscaler.jsonl line 2 (kept in deepscaler)" in issue.message
    assert len(second.rows) == 2


@pytest.mark.parametrize("progress", [True, False])
def test_progress_bar_goes_to_stderr_only_when_asked(capsys, progress):
    _prepare("gsm8k", FIXTURES / "gsm8k.jsonl", progress=progress)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert ("gsm8k: " in captured.err) == progress


def test_duplicates_point_at_the_first_kept_copy(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [
        {"problem": "What is 1?", "answer": "\\frac{"},
        {"problem": "What is 1?", "answer": "1"},
        {"problem": "What is 1?", "answer": "1"},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = _prepare("deepscaler", path, drop_duplicates=True, drop_unparsable=True)
    assert result.locations == [f"{path} line 2"]
    assert [(i.location, i.kind) for i in result.issues] == [
        (f"{path} line 1", "unparsable_answer"),
        (f"{path} line 3", "duplicate"),
    ]
    assert result.issues[1].message == f"same problem as {path} line 2"
