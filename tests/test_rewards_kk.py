"""Knights and Knaves reward: label formats and answer phrasings."""

from __future__ import annotations

import json

import pytest
from time_bounds import within

from drpo_openrlhf.rewards.kk_reward import (
    KK_REASONS,
    GradeResult,
    grade_kk,
    grade_kk_responses,
    parse_kk_answer,
    parse_kk_label,
)

# A 5-person puzzle as the K&K dataset (Xie et al. 2024) stores its solution.
SOLUTION_TEXT_FORMAT = (
    "(1) Ella is a knight\n(2) Zoey is a knave\n(3) Scarlett is a knight\n"
    "(4) Henry is a knight\n(5) Amelia is a knave"
)
SOLUTION_TEXT = (
    "Ella is a knight, Zoey is a knave, Scarlett is a knight, Henry is a knight, "
    "and Amelia is a knave."
)
SOLUTION = {"Ella": True, "Zoey": False, "Scarlett": True, "Henry": True, "Amelia": False}


@pytest.mark.parametrize(
    "label",
    [
        SOLUTION_TEXT_FORMAT,
        SOLUTION_TEXT,
        {"solution_text_format": SOLUTION_TEXT_FORMAT, "statements": "(...)"},  # Logic-RL
        json.dumps({"solution_text_format": SOLUTION_TEXT_FORMAT}),
        {"names": list(SOLUTION), "solution": list(SOLUTION.values())},  # raw dataset row
        {name: ("knight" if k else "knave") for name, k in SOLUTION.items()},
        SOLUTION_TEXT_FORMAT.encode(),
    ],
)
def test_label_formats(label):
    parsed = parse_kk_label(label)
    assert parsed == SOLUTION
    assert list(parsed) == list(SOLUTION)


@pytest.mark.parametrize(
    "label", [None, "", "no roles here", {"names": ["A"], "solution": []}, {"A": "king"}, 5]
)
def test_bad_labels(label):
    assert parse_kk_label(label) is None
    assert grade_kk("</think>A is a knight", label) == GradeResult(False, "bad_label")


CORRECT_ANSWERS = [
    SOLUTION_TEXT_FORMAT,
    SOLUTION_TEXT_FORMAT.replace("\n", " "),
    SOLUTION_TEXT,
    "Ella, Scarlett and Henry are knights, while Zoey and Amelia are knaves.",
    "Knights: Ella, Scarlett, Henry\nKnaves: Zoey, Amelia",
    "**Knights:** Ella, Scarlett, Henry. **Knaves:** Zoey, Amelia.",
    "The knights are Ella, Scarlett and Henry, and Amelia is a knave. Zoey is not a knight.",
    "- **Ella**: Knight\n- **Zoey**: Knave\n- **Scarlett**: Knight\n- **Henry**: Knight\n"
    "- **Amelia**: Knave",
    "| Name | Role |\n|---|---|\n| Ella | Knight |\n| Zoey | Knave |\n| Scarlett | Knight |\n"
    "| Henry | Knight |\n| Amelia | Knave |",
    "Ella = Knight, Zoey = Knave, Scarlett = Knight, Henry = Knight, Amelia = Knave",
    "Ella is a KNIGHT; Zoey is a KNAVE; Scarlett is a KNIGHT; Henry is a KNIGHT; "
    "Amelia is a KNAVE.",
    "Ella is a knight and Zoey a knave; Scarlett (knight), Henry (knight), Amelia (knave).",
    "Ella is a truth-teller, Zoey is a liar, Scarlett is a truth-teller, Henry is a "
    "truth-teller and Amelia is a liar.",
    "Ella isn't a knave. Zoey cannot be a knight. Scarlett is a knight. Henry is a knight. "
    "Amelia is not a knight.",
    # reported speech and hypotheticals assign nothing
    "Zoey says Scarlett is a knave. " + SOLUTION_TEXT,
    SOLUTION_TEXT + " Zoey claims that Ella is a knave, which is a lie.",
    SOLUTION_TEXT + " If Henry were a knave, Amelia would be a knight.",
    # the last assignment wins: a corrected answer
    SOLUTION_TEXT.replace("Amelia is a knave", "Amelia is a knight") + "\nWait, no. "
    "Final answer: " + SOLUTION_TEXT,
    "<answer>\n" + SOLUTION_TEXT_FORMAT + "\n</answer>",
    "Zoey is a knight.\n<answer>" + SOLUTION_TEXT_FORMAT + "</answer>",
    "$\\boxed{\\text{" + SOLUTION_TEXT + "}}$",
    # the format drpo_openrlhf.data.kk prompts for; only the conclusion counts
    "Suppose Amelia is a knight; then Zoey is a knight too. Contradiction.\n\nCONCLUSION:\n"
    + SOLUTION_TEXT_FORMAT,
]


@pytest.mark.parametrize("answer", CORRECT_ANSWERS)
def test_correct_phrasings(answer):
    assert parse_kk_answer(answer, list(SOLUTION)) == SOLUTION
    assert grade_kk("reasoning...</think>\n\n" + answer, SOLUTION_TEXT_FORMAT) == GradeResult(
        True, "ok"
    )


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (SOLUTION_TEXT.replace("Amelia is a knave", "Amelia is a knight"), "wrong"),
        (SOLUTION_TEXT_FORMAT.replace("(2) Zoey is a knave", "(2) Zoey is a knight"), "wrong"),
        ("Ella is a knight, Zoey is a knave.", "incomplete"),
        (
            SOLUTION_TEXT.replace("Amelia is a knave", "Amelia is either a knight or a knave"),
            "incomplete",
        ),
        (
            "Zoey says Amelia is a knave. Ella, Scarlett and Henry are knights. Zoey is a knave.",
            "incomplete",
        ),
        ("Ella is a knight, Zoey is a knave. Ella is a knave.", "wrong"),
        ("", "incomplete"),
        (
            "Ella, Scarlett and Henry are knights.\nCONCLUSION:\n(1) Zoey is a knave\n"
            "(2) Amelia is a knave",
            "incomplete",
        ),
        ("I could not solve it.", "incomplete"),
        (
            "ella is a knight, zoey is a knave, scarlett is a knight, henry is a knight, "
            "amelia is a knave",
            "incomplete",
        ),  # names are case-sensitive
    ],
)
def test_wrong_or_incomplete(answer, reason):
    assert grade_kk("</think>" + answer, SOLUTION_TEXT_FORMAT) == GradeResult(False, reason)


def test_think_end():
    assert grade_kk(SOLUTION_TEXT, SOLUTION_TEXT_FORMAT).reason == "no_think_end"
    assert grade_kk(SOLUTION_TEXT, SOLUTION_TEXT_FORMAT, require_think_end=False).correct
    # the answer is after </think>: a right assignment inside the thinking does not count
    assert grade_kk(SOLUTION_TEXT + "</think>", SOLUTION_TEXT_FORMAT).reason == "incomplete"


def test_names_that_contain_each_other():
    label = "(1) Ann is a knight\n(2) Anna is a knave\n(3) Annabel is a knight"
    answer = "</think>Anna is a knave, Annabel is a knight and Ann is a knight."
    assert grade_kk(answer, label).correct
    wrong = "</think>Anna is a knight, Annabel is a knight, Ann is a knight"
    assert not grade_kk(wrong, label).correct


def test_batch_garbage_and_speed():
    huge = "</think>" + "Ella Zoey knight knave " * 200_000 + SOLUTION_TEXT
    responses = [None, b"</think>" + SOLUTION_TEXT.encode(), 42, huge, "</think>" + SOLUTION_TEXT]
    labels = [SOLUTION_TEXT_FORMAT] * 4 + [object()]
    # CPU time: 0.01 s measured (2 cores at load 6-7; AVX2-held kernels alike); 10 s leaves
    # room for any linear scan of the 4.6 MB answer, none for a quadratic one
    with within(10, "grading a batch with a 4.6 MB answer", cpu=True):
        results = grade_kk_responses(responses, labels)
    assert all(r.reason in KK_REASONS for r in results)
    assert [r.correct for r in results] == [False, True, False, True, False]
    with pytest.raises(ValueError):
        grade_kk_responses(["a"], [])
