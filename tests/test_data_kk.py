"""K&K puzzles: label format, its parser, and conversion of the fixture puzzles."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drpo_openrlhf.data.convert import Excluded, RowError
from drpo_openrlhf.data.kk import KK_SUFFIX, format_assignment, kk_converter, parse_assignment
from drpo_openrlhf.data.readers import read_local

FIXTURES = Path(__file__).parent / "fixtures" / "data"

names_st = st.lists(
    st.from_regex(r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?", fullmatch=True),
    min_size=1,
    max_size=8,
    unique=True,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(names_st, st.data())
def test_label_round_trips(names, data):
    knights = data.draw(st.lists(st.booleans(), min_size=len(names), max_size=len(names)))
    label = format_assignment(names, knights)
    assert label.splitlines()[0].startswith("(1) ")
    assert parse_assignment(label) == dict(zip(names, knights, strict=True))


def test_label_is_the_numbered_conclusion_block():
    assert format_assignment(["Ella", "Zoey"], [True, False]) == (
        "(1) Ella is a knight\n(2) Zoey is a knave"
    )


def test_parser_tolerates_case_spacing_and_periods():
    text = "\n  (1) Ella is a Knight.\n\n(2)Zoey  is  a knave  \n"
    assert parse_assignment(text) == {"Ella": True, "Zoey": False}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no role assignment lines"),
        ("(1) Ella is a knight\n(3) Zoey is a knave", "numbered 3, expected 2"),
        ("(1) Ella is a knight\n(2) Ella is a knave", "assigned twice"),
        ("(1) Ella is honest", "is not '(i) NAME is a knight|knave'"),
    ],
)
def test_parser_rejects_malformed_labels(text, message):
    with pytest.raises(ValueError, match=message):
        parse_assignment(text)


@pytest.mark.parametrize("split", ["train", "test"])
def test_fixture_puzzles_convert_to_their_solutions(split):
    convert = kk_converter(range(2, 9))
    for raw in read_local(FIXTURES / "kk" / split):
        record = raw.record
        row = convert(record)
        assert row.prompt == record["quiz"] + KK_SUFFIX
        assert row.label == record["solution_text_format"]
        expected = dict(zip(record["names"], record["solution"], strict=True))
        assert parse_assignment(row.label) == expected
        assert row.datasource == f"kk_{len(record['names'])}ppl"


def test_suffix_asks_for_the_conclusion_lines_not_a_boxed_answer():
    assert "CONCLUSION:" in KK_SUFFIX and "(1) <name> is a knight" in KK_SUFFIX
    assert "boxed" not in KK_SUFFIX


def test_puzzles_outside_the_size_range_are_excluded():
    record = next(iter(read_local(FIXTURES / "kk" / "train" / "people2_num1.jsonl"))).record
    with pytest.raises(Excluded, match="2-person puzzle outside 3-7"):
        kk_converter(range(3, 8))(record)


def test_bad_rows_raise_row_errors_of_the_right_kind():
    convert = kk_converter(range(1, 9))
    kinds = []
    for raw in read_local(FIXTURES / "bad" / "kk_rows.jsonl"):
        with pytest.raises(RowError) as info:
            convert(raw.record)
        kinds.append(info.value.kind)
    assert kinds == ["missing", "bad_format", "wrong_type", "bad_format", "bad_format", "empty"]
