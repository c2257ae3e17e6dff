"""Every math source converts its fixture (real column names) into prompt/label/datasource."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from drpo_openrlhf.data.convert import (
    MATH_SUFFIX,
    RowError,
    answer_list_text,
    answer_text,
    gsm8k_final_answer,
)
from drpo_openrlhf.data.readers import read_local
from drpo_openrlhf.data.sources import GROUPS, build_sources

FIXTURES = Path(__file__).parent / "fixtures" / "data"
SOURCES = build_sources(range(3, 8), range(2, 9))

# (source, fixture, column holding the problem, expected labels worked out by hand)
CASES = [
    ("deepscaler", "deepscaler.json", "problem", ["55", "4", "\\frac{3}{4}", "5\\sqrt{2}"]),
    ("gsm8k", "gsm8k.jsonl", "question", ["26", "6", "1,550"]),
    ("math500", "math500.jsonl", "problem", ["(2, -1)", "\\frac{3}{4}", "\\text{(B)}"]),
    ("olympiadbench", "olympiadbench.jsonl", "question", ["\\frac{1}{2}", "3, 5", "(1,2)"]),
    ("aime2024", "aime2024.jsonl", "problem", ["15", "001"]),
    ("aime2025", "aime2025.jsonl", "problem", ["77", "11"]),
    ("amc", "amc.jsonl", "problem", ["36", "54", "8"]),
    ("minerva", "minerva.jsonl", "question", ["75", "7.5 \\times 10^{-3}"]),
]


def test_authors_suffix_is_appended_verbatim():
    assert MATH_SUFFIX == " Let's think step by step and output the final answer within \\boxed{}."


@pytest.mark.parametrize(("name", "fixture", "column", "labels"), CASES)
def test_fixture_converts_to_expected_rows(name, fixture, column, labels):
    source = SOURCES[name]
    records = [raw.record for raw in read_local(FIXTURES / fixture)]
    rows = [source.convert(record) for record in records]
    assert [row.label for row in rows] == labels
    assert [row.prompt for row in rows] == [r[column].strip() + MATH_SUFFIX for r in records]
    assert {row.datasource for row in rows} == {name}
    assert source.math


def test_every_source_has_a_fixture_case_and_groups_name_real_sources():
    covered = {case[0] for case in CASES} | {"kk-train", "kk-test"}
    assert covered == set(SOURCES)
    assert {name for names in GROUPS.values() for name in names} <= set(SOURCES)


def test_kk_hub_splits_follow_the_people_range():
    sources = build_sources(range(4, 6), range(2, 3))
    assert sources["kk-train"].hub.splits == ("4ppl", "5ppl")
    assert sources["kk-train"].hub.config == "train"
    assert sources["kk-test"].hub.splits == ("2ppl",)


def test_capitalised_columns_of_other_copies_are_accepted():
    row = SOURCES["aime2024"].convert({"ID": "2024-I-1", "Problem": "Find $x$.", "Answer": 204})
    assert (row.problem, row.label) == ("Find $x$.", "204")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (142, "142"),
        (142.0, "142"),
        (0.5, "0.5"),
        (" $\\frac{1}{2}$ ", "\\frac{1}{2}"),
        ("\\$18.90", "\\$18.90"),
        ("(1, 2)", "(1, 2)"),
    ],
)
def test_answer_text_normalises_scalars(value, expected):
    assert answer_text(value, "answer") == expected


@pytest.mark.parametrize("value", [True, math.nan, math.inf, {"v": 1}, ["1"]])
def test_answer_text_rejects_other_types(value):
    with pytest.raises(RowError) as info:
        answer_text(value, "answer")
    assert info.value.kind == "wrong_type"
    assert "answer field 'answer'" in info.value.message


def test_answer_lists_join_and_reject_empty_items():
    assert answer_list_text(["$3$", 5], "final_answer") == "3, 5"
    with pytest.raises(RowError) as info:
        answer_list_text(["$3$", "$ $"], "final_answer")
    assert info.value.kind == "empty"


def test_gsm8k_final_answer_is_the_text_after_the_last_marker():
    assert gsm8k_final_answer("a #### b\nc = 4\n#### 4", "answer") == "4"
    assert gsm8k_final_answer("-12", "answer") == "-12"
    assert gsm8k_final_answer(7, "answer") == "7"
    with pytest.raises(RowError) as info:
        gsm8k_final_answer("She has 2 + 1 = 3 cats.", "answer")
    assert info.value.kind == "bad_format"
    assert "no '####'" in info.value.message
