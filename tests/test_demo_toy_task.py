"""The toy task: problems, traces of the paper's shape, and their token budget."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from drpo_openrlhf.demo.toy_task import (
    RECHECK,
    ToyProblem,
    ToyTaskConfig,
    render_trace,
    response_shape,
    sample_problem,
    sample_traces,
    write_jsonl,
)
from drpo_openrlhf.eval.problems import load_problems
from drpo_openrlhf.models.tiny import build_tiny_model
from drpo_openrlhf.rewards import grade_responses


def test_problem_fields_and_steps() -> None:
    p = ToyProblem((7, 5, 9))
    assert p.prompt == "Compute 7+5+9."
    assert p.label == "21"
    assert p.datasource == "add3"
    assert p.steps() == ["7+5=12", "12+9=21"]


def test_trace_shapes() -> None:
    p = ToyProblem((7, 5, 9))
    assert render_trace(p, 0, skip=True) == "<think>\n</think>\n\\boxed{21}"
    assert render_trace(p, 0, skip=False) == "<think>\n7+5=12\n12+9=21\n</think>\n\\boxed{21}"
    verbose = render_trace(p, 2, skip=False)
    assert verbose.count(RECHECK) == 2
    assert verbose.count("12+9=21\n") == 3


def test_traces_are_graded_correct_by_the_math_reward() -> None:
    problems = [ToyProblem((3, 4)), ToyProblem((9, 9, 9, 9))]
    responses = [render_trace(p, r, s) for p in problems for r in (0, 3) for s in (False, True)]
    labels = [p.label for p in problems for _ in range(4)]
    assert all(g.correct for g in grade_responses(responses, labels))
    wrong = grade_responses([render_trace(ToyProblem((3, 5)), 1, False)], ["7"])
    assert not wrong[0].correct


def test_sampling_is_seeded_and_within_the_config() -> None:
    config = ToyTaskConfig(min_terms=2, max_terms=3, max_operand=4)
    first = [sample_problem(random.Random(3), config) for _ in range(5)]
    again = [sample_problem(random.Random(3), config) for _ in range(5)]
    assert first == again
    problems = [sample_problem(random.Random(i), config) for i in range(200)]
    assert {len(p.operands) for p in problems} == {2, 3}
    assert {x for p in problems for x in p.operands} == {1, 2, 3, 4}


def test_trace_mix_follows_the_config() -> None:
    config = ToyTaskConfig(max_rechecks=2, skip_prob=0.25)
    traces = sample_traces(random.Random(0), config, [ToyProblem((1, 2, 3))])
    responses = [next(traces)[1] for _ in range(2000)]
    skipped = sum(r.startswith("<think>\n</think>") for r in responses) / len(responses)
    assert skipped == pytest.approx(0.25, abs=0.03)
    rechecks = {r.count(RECHECK) for r in responses if "+" in r}
    assert rechecks == {0, 1, 2}


def test_longest_trace_fits_the_demo_generation_budget(tmp_path) -> None:
    """The demo samples 128 new tokens: the SFT data must never need more (EOS included)."""
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny"))
    config = ToyTaskConfig()
    worst = ToyProblem((config.max_operand,) * config.max_terms)
    text = render_trace(worst, config.max_rechecks, skip=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) + 1 <= 128
    assert tokenizer.decode(ids) == text


def test_jsonl_is_read_back_per_datasource(tmp_path) -> None:
    problems = [ToyProblem((1, 2)), ToyProblem((3, 4, 5)), ToyProblem((6, 7))]
    datasets = load_problems([write_jsonl(problems, tmp_path / "toy.jsonl")])
    assert list(datasets) == ["add2", "add3"]
    assert [(p.prompt, p.label) for p in datasets["add2"]] == [
        ("Compute 1+2.", "3"),
        ("Compute 6+7.", "13"),
    ]


@pytest.mark.parametrize(("rechecks", "skip"), [(0, False), (2, False), (0, True)])
def test_response_shape_reads_back_the_trace(rechecks: int, skip: bool) -> None:
    text = render_trace(ToyProblem((4, 5, 6)), rechecks, skip)
    assert response_shape(text) == (skip, rechecks)


def test_response_shape_of_a_truncated_response() -> None:
    assert response_shape("<think>\n1+2=3\nWait, let me check.\n1+2") == (False, 1)
