"""Grading on real-world label forms: one table per failure class, both directions."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drpo_openrlhf.rewards.label_forms import (
    canonical,
    decode_alternatives,
    encode_alternatives,
    gold_forms,
    is_text_label,
)
from drpo_openrlhf.rewards.math_reward import REASONS, grade_responses

# (label, boxed answer, must be correct)
CASES = {
    "small magnitudes are compared relatively": [
        ("8.2\\times10^{-19}", "8.2 \\times 10^{-19}", True),
        ("1.45 \\times 10^{-5}", "0.0000145", True),
        ("3.3e-10", "3.3 \\times 10^{-10}", True),
        ("8.2\\times10^{-19}", "8.2 \\times 10^{-21}", False),
        ("8.2\\times10^{-19}", "0.0000001", False),
        ("3.89e-10", "3.9e-10", False),
        ("0.0005", "0.0006", False),
    ],
    "scientific notation both ways": [
        ("2.88e-19", "2.88 \\times 10^{-19}", True),
        ("2.88 \\times 10^{-19}", "2.88e-19", True),
        ("4.4e7", "44000000", True),
        ("10^{-3}", "0.001", True),
        ("7.5 \\times 10^7", "7.5\\cdot 10^{7}", True),
        ("2.88e-19", "2.88e-18", False),
        ("4.4e7", "4.4 \\times 10^{6}", False),
    ],
    "trailing period": [
        ("\\begin{pmatrix}1\\\\2\\end{pmatrix}.", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
        ("5.", "5", True),
        ("(-\\infty, 0) \\cup\\{1\\}.", "(-\\infty,0)\\cup\\{1\\}", True),
        ("\\begin{pmatrix}1\\\\2\\end{pmatrix}.", "-1", False),
        ("\\begin{pmatrix}1\\\\2\\end{pmatrix}.", "\\begin{pmatrix}1\\\\3\\end{pmatrix}", False),
    ],
    "name = value labels": [
        ("y=cx^{-2}-\\frac{\\cos(2x)}{2x^{2}}", "cx^{-2}-\\frac{\\cos(2x)}{2x^2}", True),
        ("X_{d}=125-1.25 P", "125-1.25P", True),
        ("\\lambda = 500", "500", True),
        ("x=5", "x = 5", True),
        ("X_{d}=125-1.25 P", "125", False),
        ("f(x)=2 x", "2", False),
        ("\\lambda = 500", "50", False),
    ],
    "units in text": [
        ("15000 \\text{ kcal m}^{-2} \\text{yr}^{-1}", "15000", True),
        ("4.4677 \\times 10^{14} Hz", "4.4677 \\times 10^{14}", True),
        ("6.43 \\times 10^{16} \\text{ cm}^{-3}", "6.43e16", True),
        ("5.4 \\text{ cents}", "5.4", True),
        ("5", "5 \\text{ cm}", True),
        ("15000 \\text{ kcal m}^{-2} \\text{yr}^{-1}", "1500", False),
        ("6.43 \\times 10^{16} \\text{ cm}^{-3}", "6.43e15", False),
        ("2 x", "2", False),  # a one-letter variable is not a unit
    ],
    "words and named quantities are graded as text": [
        ("\\text{Evelyn}", "Evelyn", True),
        ("\\text{(C)}", "C", True),
        ("SRAC=LRAC", "SRAC = LRAC", True),
        ("\\text{Evelyn}", "0", False),
        ("3 \\text{ apples and } 2 \\text{ pears}", "3", False),
        ("SRAC=LRAC", "2", False),
        ("\\text{east}", "2", False),
    ],
    "spacing of comma-separated answers": [
        ("1, 2, 3", "1,2,3", True),
        ("1,2,3", "1, 2, 3", True),
        ("(1, 2)", "(1,2)", True),
        ("1, 2, 3", "1, 2, 4", False),
    ],
    "lists of acceptable answers": [
        ('["0.01", "0.02"]', "0.01", True),
        ('["0.01", "0.02"]', "0.02", True),
        ('["4.4e7", "4.4 \\\\times 10^7"]', "44000000", True),
        ('["0.01", "0.02"]', "0.03", False),
        ('["\\\\text{east}", "\\\\text{E}"]', "2", False),
    ],
    # issue 27: forms where plain math-verify was right and the grader was not
    "variable names and assignments": [
        ("$AB=4,CD=5$", "4, 5", True),
        ("p = -1 \\text{ and } p = \\frac{15}{8}", "p=-1,p=\\frac{15}{8}", True),
        ("k = 45, n = 2", "n = 2, k = 45", True),
        ("a=2, a=-6-4 \\sqrt{2}", "2, -6-4\\sqrt{2}", True),
        ("$AB=4,CD=5$", "4, 6", False),
        ("k = 45, n = 2", "k = 45", False),
        ("p = -1 \\text{ and } p = \\frac{15}{8}", "p = -1", False),
    ],
    "units outside the math": [
        ("$125$ miles", "125\\textnormal{ miles}", True),
        ("$125$ miles", "125", True),
        ("$125$ miles", "126 \\text{ miles}", False),
    ],
    "thousands separators": [
        ("11,\\! 111,\\! 111,\\! 100", "11111111100", True),
        ("10,\\!080", "10{,}080", True),
        ("11111111100", "11,\\! 111,\\! 111,\\! 100", True),
        ("11,\\! 111,\\! 111,\\! 100", "1111111100", False),
    ],
    "decimal commas": [
        ("1000,99", "1000.99", True),
        ("3.25", "3,25", True),
        ("3.14159", "3,14159", True),
        ("3.25", "3,52", False),
        ("1000,99", "99", False),
        ("1500", "1,500", True),  # three digits after a comma: a thousands group
        ("1.5", "1,500", False),
    ],
    "equivalent expressions in another order": [
        ("abc", "cba", True),
        ("6\\pi\\sqrt{3}", "6\\sqrt{3}\\pi", True),
        ("SRAC=LRAC", "LRAC=SRAC", True),
        ("abc", "ab", False),
    ],
    # issue 37: forms graded worse than plain math-verify, and their near misses
    "labels holding several boxes": [
        ("\\boxed{4}\\boxed{9}", "4, 9", True),
        ("\\boxed{4}\\boxed{9}", "\\{9, 4\\}", True),
        ("$\\boxed{-1}, \\boxed{6}$", "-1, 6", True),
        ("\\boxed{3} cats and \\boxed{5} dogs", "3, 5", True),
        ("\\boxed{p = 3}, \\boxed{q = 8}", "p=3, q=8", True),
        ("\\boxed{4}\\boxed{9}", "9", False),  # a member missing
        ("\\boxed{4}\\boxed{9}", "4, 9, 16", False),  # an extra member
        ("\\boxed{3} cats and \\boxed{5} dogs", "3, 6", False),
        ("\\boxed{p = 3}, \\boxed{q = 8}", "p = 3", False),
    ],
    "chains and equations": [
        ("u = v = 0", "0", True),
        ("u = v = 0", "u=v=0", True),
        ("g(t) = 5t - 1", "5t-1", True),
        ("h^{-1}(x) = \\frac{x}{3}", "\\frac{x}{3}", True),
        ("3^{4} = 81", "81", True),
        ("T = \\frac{1}{2} \\cdot 6 \\cdot 7 = 21", "21", True),
        ("u = v = 0", "1", False),
        ("g(t) = 5t - 1", "5t+1", False),
        ("3^{4} = 81", "82", False),
        # a number on the left states what the right side equals: not an answer alone
        ("7 = 11a+c", "11a+c", False),
        ("7 = 11a+c", "11a+c = 7", True),
        ("x = 11a+c", "11a+c", True),  # a variable on the left: its value
        ("x = 5+5+1 = 11", "11", True),
        ("12 = 3 \\cdot 4", "3 \\cdot 4", True),  # arithmetic on both sides
    ],
    "systems of equations": [
        ("\\begin{cases} 2a+b=7 \\\\ a-b=2 \\end{cases}", "2a+b=7, a-b=2", True),
        ("\\left\\{\\begin{array}{l} a=3 \\\\ b=1 \\end{array}\\right.", "a=3, b=1", True),
        ("a=3 \\\\ b=1", "b = 1, a = 3", True),
        ("\\begin{cases} 2a+b=7 \\\\ a-b=2 \\end{cases}", "2a+b=7", False),
        ("\\begin{cases} 2a+b=7 \\\\ a-b=2 \\end{cases}", "2a+b=7, a-b=3", False),
        ("a=3 \\\\ b=1", "a=3, b=2", False),
    ],
    "label clutter": [
        ("42\\", "42", True),
        ("\\frac{2}{9}\\", "\\frac{2}{9}", True),
        ("9weeks", "9", True),
        ("9weeks", "9 \\text{ weeks}", True),
        ("30cm^2", "30", True),
        ("15 cubic centimeters", "15", True),
        ("4 full boxes", "4", True),
        ("42\\", "24", False),
        ("9weeks", "10", False),
        ("15 cubic centimeters", "16", False),
        ("2ab", "2", False),  # a product of letters, not a unit
        ("3 \\text{ apples and } 2 \\text{ pears}", "2", False),
    ],
    "another unit": [
        ("9weeks", "9 \\text{ days}", False),
        ("15 \\text{ cm}", "15 \\text{ m}", False),
        ("6 square meters", "6 \\text{ ft}^2", False),
        ("15 cubic centimeters", "15 \\text{ m}", False),
        ("15 cubic centimeters", "15 \\text{ cm}^3", True),
        ("6 square meters", "6 \\text{ m}^2", True),
        ("15 \\text{ cm}", "15 \\text{ centimeters}", True),
        ("15 \\text{ cm}", "15", True),
    ],
    "only a bare name's value stands alone": [
        ("\\lambda = 500", "500", True),
        ("x = 5", "x = 5", True),
        ("\\tan(\\theta) = 2", "\\tan(\\theta) = 2", True),
        ("\\tan(\\theta) = 2", "2", True),  # math-verify's reading of an assignment
        ("\\tan(\\theta) = 2", "\\sin(\\theta) = 2", False),  # another left-hand side
        ("x = 5", "y = 5", False),
        ("f(x) = 2x", "g(x) = 3x", False),
        ("r = 4", "r = 5", False),
    ],
    "a variable before an interval": [
        ("s(1,7]", "(1,7]", True),
        ("s(1,7]", "s \\in (1, 7]", True),
        ("y[-2,5)", "[-2,5)", True),
        ("y \\in [-2, 5)", "[-2,5)", True),
        ("[-2, 5)", "y \\in [-2,5)", True),
        ("s(1,7]", "[1,7]", False),
        ("s(1,7]", "(1,7)", False),
        ("P(1,7)", "(1,7)", False),  # a point, not an interval
    ],
    "subscripts with and without braces": [
        ("E_{1},E_{2}", "E_1, E_2", True),  # math-verify cannot parse these E's
        ("E_1,E_2", "E_{1},E_{2}", True),
        ("E_{1},E_{2}", "E_1, E_3", False),
        ("F_{1},F_{2}", "F_1, F_2", True),
        ("F_1,F_2", "F_{1}, F_{2}", True),
        ("y_{1}, y_{2}", "y_1,y_2", True),
        ("F_{1},F_{2}", "F_1, F_3", False),
        ("F_{1},F_{2}", "F_1", False),
        ("F_{12}", "F_1 2", False),
    ],
}
TABLE = [(cls, *case) for cls, cases in CASES.items() for case in cases]


def r1(answer: str) -> str:
    return f"Reasoning.</think>\nSo the answer is $\\boxed{{{answer}}}$."


def test_every_class_has_both_directions():
    for cls, cases in CASES.items():
        assert {expected for _, _, expected in cases} == {True, False}, cls


def test_table():
    results = grade_responses([r1(a) for _, _, a, _ in TABLE], [lab for _, lab, _, _ in TABLE])
    wrong = [
        (cls, label, answer, result)
        for (cls, label, answer, expected), result in zip(TABLE, results, strict=True)
        if result.correct != expected or result.reason not in REASONS
    ]
    assert not wrong


# (label, answer part of the response, correct): the final group of boxes is one answer
SEVERAL_BOXES = [
    ("(2, 2), (6, 2)", "So $\\boxed{(2, 2)}$ and $\\boxed{(6, 2)}$.", True),
    ("(2, 2), (6, 2)", "\\boxed{(6, 2)}, \\boxed{(2, 2)}", True),
    ("\\{1,2,3\\}", "$\\boxed{1},\\boxed{2},\\boxed{3}$", True),
    ("k = 45, n = 2", "$\\boxed{k = 45} \\quad \\text{and} \\quad \\boxed{n = 2}$", True),
    ("\\frac{1}{2}, -3", "\\boxed{\\frac{1}{2}} \\text{ or } \\boxed{-3}", True),
    ("5", "$\\boxed{5}$ or $\\boxed{5}$", True),  # the same part twice counts once
    ("7", "First $\\boxed{3}$? No: the answer is $\\boxed{7}$.", True),  # words: not one answer
    # a missing part, an extra part
    ("(2, 2), (6, 2)", "So $\\boxed{(2, 2)}$.", False),
    ("\\{1,2,3\\}", "$\\boxed{1},\\boxed{2}$", False),
    ("(2, 2), (6, 2)", "$\\boxed{(2, 2)}$, $\\boxed{(6, 2)}$ and $\\boxed{(1, 1)}$", False),
    ("\\{1,2,3\\}", "$\\boxed{1},\\boxed{2},\\boxed{3},\\boxed{4}$", False),
    ("3", "$\\boxed{2}, \\boxed{3}$", False),
    ("k = 45, n = 2", "$\\boxed{k = 45}$", False),
    # issue 37: words between the boxes of a multi-part answer, as math-verify groups them
    ("4, 9", "We get $\\boxed{4}$ red and $\\boxed{9}$ blue.", True),
    ("(4, 9)", "so $a = \\boxed{4}$ and $b = \\boxed{9}$", True),
    ("\\boxed{4}\\boxed{9}", "We get $\\boxed{4}$ red and $\\boxed{9}$ blue.", True),
    ("4, 9", "We get $\\boxed{4}$ red and $\\boxed{8}$ blue.", False),
    ("4, 9", "We get $\\boxed{4}$ red, $\\boxed{9}$ blue and $\\boxed{1}$ green.", False),
]


def test_several_boxes_form_one_answer():
    results = grade_responses(
        [f"Reasoning.</think>\n{a}" for _, a, _ in SEVERAL_BOXES],
        [lab for lab, _, _ in SEVERAL_BOXES],
    )
    assert [r.correct for r in results] == [c for _, _, c in SEVERAL_BOXES]


def test_text_labels_fail_with_their_own_reason():
    (result,) = grade_responses([r1("0")], ["\\text{Evelyn}"])
    assert result.reason == "text_mismatch" and "text_mismatch" in REASONS


@pytest.mark.parametrize(
    ("label", "text"),
    [
        ("\\text{Evelyn}", True),
        ("east", True),
        ("\\text{(C)}", True),
        ("\\textbf{(B)}", True),
        ("k = 45, n = 2", False),  # assignments are math-verify's
        ("p = -1 \\text{ and } p = \\frac{15}{8}", False),
        ("SRAC=LRAC", False),
        ("3 \\text{ apples}", False),
        ("x", False),
    ],
)
def test_only_real_text_is_a_text_label(label, text):
    assert is_text_label(canonical(label)) is text


def test_list_labels_may_be_python_lists():
    results = grade_responses([r1("0.02"), r1("0.03")], [["0.01", "0.02"]] * 2)
    assert [r.correct for r in results] == [True, False]


def test_list_encoding_round_trips_and_single_answers_stay_plain():
    answers = ["\\frac{1}{2}", 'say "hi"', "[1, 2)"]
    assert decode_alternatives(encode_alternatives(answers)) == answers
    assert encode_alternatives(["4\n", "4"]) == "4"
    assert decode_alternatives("[1, 2]") == ["[1, 2]"]  # an interval is not a list label
    assert decode_alternatives('["unclosed"') == ['["unclosed"']


def test_canonical_keeps_matrix_row_breaks():
    assert canonical("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}").count("\\\\") == 1
    assert gold_forms("") == ([], [])


mantissas = st.integers(min_value=100, max_value=999)
exponents = st.integers(min_value=-30, max_value=30)
signs = st.sampled_from([1, -1])


def latex_sci(mantissa: int, exponent: int, sign: int) -> str:
    return f"{'-' if sign < 0 else ''}{mantissa / 100:.2f} \\times 10^{{{exponent}}}"


@settings(max_examples=40, deadline=None)
@given(mantissas, exponents, signs)
def test_a_number_equals_itself_in_every_notation(mantissa, exponent, sign):
    label = latex_sci(mantissa, exponent, sign)
    value = sign * Decimal(mantissa).scaleb(exponent - 2)
    answers = [label, f"{value:e}", format(value, "f")]
    assert all(r.correct for r in grade_responses([r1(a) for a in answers], [label] * 3))


@settings(max_examples=40, deadline=None)
@given(mantissas, exponents, signs, st.sampled_from(["1.011", "0.989", "1.5", "0.5", "-1"]))
def test_a_number_off_by_more_than_one_percent_is_wrong(mantissa, exponent, sign, factor):
    label = latex_sci(mantissa, exponent, sign)
    value = sign * Decimal(mantissa).scaleb(exponent - 2) * Decimal(factor)
    answers = [f"{value:e}", format(value, "f")]
    results = grade_responses([r1(a) for a in answers], [label] * 2)
    assert not any(r.correct for r in results), (label, answers, results)
