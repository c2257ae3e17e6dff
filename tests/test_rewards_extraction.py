"""Answer extraction for the rewards: response cutting, </think>, \\boxed, labels."""

import pytest
from time_bounds import within

from drpo_openrlhf.rewards.answer_extraction import (
    MAX_FINAL_BOXES,
    answer_part,
    final_boxes,
    last_boxed,
    normalize_label,
    split_query,
    to_text,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{5}.", "5"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{\\{a\\}}}{2}}", "\\frac{\\sqrt{\\{a\\}}}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("$\\boxed 5$", "5"),
        ("\\boxed 42.\nmore", "42"),
        ("\\fbox{7}", "7"),
        ("\\boxed{1} and \\fbox{3}", "3"),
        ("\\boxed { 5 }", " 5 "),
        ("\\boxed{1} then \\boxed{2", "1"),  # unclosed last box: the previous one
        ("\\boxed{}", ""),
        ("\\boxedfoo{5}", None),
        ("\\boxed5", None),
        ("no box here", None),
        ("\\boxed{", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{5}.", ["5"]),
        ("\\boxed{1} then \\boxed{2}", ["2"]),
        ("$\\boxed{(2, 2)}$ and $\\boxed{(6, 2)}$.", ["(2, 2)", "(6, 2)"]),
        ("\\boxed{1},\\boxed{2},\\boxed{3}", ["1", "2", "3"]),
        ("\\boxed{k=4} \\quad \\text{and} \\quad \\boxed{n=2}", ["k=4", "n=2"]),
        ("\\[\\boxed{1}\\]\\[\\boxed{2}\\]", ["1", "2"]),
        ("\\boxed{1} or \\fbox{3}", ["1", "3"]),
        ("\\boxed{1}. So \\boxed{2}", ["2"]),  # a sentence between: not one answer
        ("\\boxed{1}, \\boxed{2} then \\boxed{3", ["1", "2"]),  # unclosed last box
        ("\\boxed{1} andrew \\boxed{2}", ["2"]),
        ("no box", None),
    ],
)
def test_final_boxes(text, expected):
    assert final_boxes(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{1} apples and \\boxed{2} pears", ["1", "2"]),  # words with "and"
        ("\\boxed{1}. So \\boxed{2}", ["1", "2"]),  # any gap under 10 characters
        ("x is $\\boxed{1}$; then y is $\\boxed{2}$", ["1", "2"]),
        ("\\boxed{1} is what we first found, then \\boxed{2}", ["1", "2"]),
        ("\\boxed{3} is what we first found, then \\boxed{3}", ["3"]),  # same content
        ("\\boxed{1} is what we first found but it fails: \\boxed{2}", ["2"]),  # no separator
        ("\\boxed{1}" + "x" * 70 + ", \\boxed{2}", ["2"]),  # too far apart
    ],
)
def test_final_boxes_loose_is_math_verify_grouping(text, expected):
    assert final_boxes(text, loose=True) == expected


def test_final_boxes_is_bounded():
    text = "\\boxed{1}, " * 100_000 + "\\boxed{2}"
    parts = final_boxes(text)
    assert parts is not None and len(parts) == MAX_FINAL_BOXES and parts[-1] == "2"
    assert final_boxes("{" * 2_000_000 + "\\boxed{" + "{" * 1_000_000) is None


def test_last_boxed_is_linear_on_megabytes():
    text = "{" * 2_000_000 + "\\boxed{" + "{" * 1_000_000
    assert last_boxed(text) is None
    assert last_boxed("x" * 5_000_000 + "\\boxed{9}") == "9"


@pytest.mark.parametrize(
    ("response", "require", "expected"),
    [
        ("think</think>answer", True, "answer"),
        ("a</think>b</think>c", True, "b</think>c"),
        ("no end of thinking \\boxed{1}", True, None),
        ("no end of thinking \\boxed{1}", False, "no end of thinking \\boxed{1}"),
        ("t</think>x", False, "x"),
        ("", True, None),
    ],
)
def test_answer_part(response, require, expected):
    assert answer_part(response, require) == expected


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("The answer is $\\boxed{3}$.", "3"),
        ("$5$", "5"),
        ("\\(x+1\\)", "x+1"),
        ("  7 ", "7"),
        (7, "7"),
        (0.5, "0.5"),
        (b"12", "12"),
        (None, None),
        ("", None),
        ("   ", None),
        ("$$", None),
        ("\\boxed{1}\\boxed{2}", "1, 2"),  # several boxes: the list of their contents
        ("\\boxed{2}, \\boxed{3}", "2, 3"),
        ("$\\boxed{5}$ or $\\boxed{5}$", "5"),
        ("\\boxed{1} apples and \\boxed{2} pears", "1, 2"),
    ],
)
def test_normalize_label(label, expected):
    assert normalize_label(label) == expected


def test_to_text():
    assert to_text(b"\xff\xfeab") == "\ufffd\ufffdab"
    assert to_text(None) is None
    assert to_text(3) == "3"


def test_split_query_exact_prefix():
    prompt = "<|User|>What is 1+1?<|Assistant|><think>\n"
    assert split_query(prompt + "hm</think>\\boxed{2}", prompt) == ("hm</think>\\boxed{2}", True)


def test_split_query_prompt_with_think_end_is_cut_off():
    prompt = "Example: <think>a</think>\\boxed{1}\nNow: <|Assistant|><think>\n"
    response, found = split_query(prompt + "truncated reasoning", prompt)
    assert found and response == "truncated reasoning"


def test_split_query_decode_drift_and_left_truncation():
    prompt = "User:  What is 1+1?\nAssistant: <think>\n"
    # decode normalised a double space and the prompt was left-truncated
    query = "What is 1+1?\nAssistant: <think>\nok</think>\\boxed{2}"
    assert split_query(query, prompt) == ("ok</think>\\boxed{2}", True)
    drifted = "User: What is 1+1?\nAssistant: <think>\nok</think>\\boxed{2}"
    assert split_query(drifted, prompt) == ("ok</think>\\boxed{2}", True)


def test_split_query_prompt_not_found():
    assert split_query("something else entirely", "the prompt") == (
        "something else entirely",
        False,
    )
    assert split_query("q", None) == ("q", False)
    assert split_query("q", "") == ("q", True)


def test_last_boxed_many_unclosed_boxes_is_fast():
    # CPU time: 0.23-0.35 s measured (2 cores at load 6-7; AVX2-held kernels alike); 5 s is
    # 14x that, and a rescan from each unclosed box (about 10^11 characters) takes minutes
    with within(5, "last_boxed over 200,000 unclosed boxes", cpu=True):
        assert last_boxed("\\boxed{1}" + "\\boxed{" * 200_000) == "1"
        assert last_boxed("\\boxed{a \\boxedfoo b}") == "a \\boxedfoo b"
