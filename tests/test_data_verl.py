"""verl-style rows (chat-message prompt, reward_model.ground_truth) and list answers."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from drpo_openrlhf.data.cli import main
from drpo_openrlhf.rewards.label_forms import decode_alternatives
from drpo_openrlhf.rewards.math_reward import grade_responses

SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."


def verl_row(problem: str, truth: object, source: str = "", index: int = 0) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": problem + SUFFIX}],
        "ability": "math",
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": {"index": index, "split": "test"},
    }


def write_parquet(path: Path, rows: list[dict], truth_type: pa.DataType) -> Path:
    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", truth_type), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string())])),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(tmp_path: Path, *inputs: str, out_name: str = "out") -> list[dict]:
    out = tmp_path / out_name
    argv = [arg for spec in inputs for arg in ("--input", spec)]
    assert main([*argv, "--out-dir", str(out), "--no-progress"]) == 0
    return read_jsonl(next(out.glob("*.jsonl")))


# Whitespace at either end and a "$" price are kept exactly: the prompt is the authors'.
PROBLEMS = ["\nHow many primes are below $10$?  ", "A pen costs $2. Find 3 pens' cost."]


def test_parquet_prompt_is_kept_exactly_and_label_comes_from_ground_truth(tmp_path):
    rows = [verl_row(PROBLEMS[0], "4", index=0), verl_row(PROBLEMS[1], "6", "mine", 1)]
    path = write_parquet(tmp_path / "aime.parquet", rows, pa.string())
    out = run(tmp_path, f"aime2024={path}")
    assert [r["prompt"] for r in out] == [p + SUFFIX for p in PROBLEMS]
    assert [r["label"] for r in out] == ["4", "6"]
    # an empty data_source (as in the released files) falls back to the source's name
    assert [r["datasource"] for r in out] == ["aime2024", "mine"]


@pytest.mark.parametrize(
    ("truth_type", "truths", "labels"),
    [
        (pa.int64(), [70, 588], ["70", "588"]),  # AIME 2025 stores integers
        (pa.float64(), [142.0, 2.5], ["142", "2.5"]),  # AMC stores floats
        (pa.list_(pa.string()), [["2"], ["\\frac{1}{2}"]], ["2", "\\frac{1}{2}"]),
    ],
)
def test_ground_truth_types(tmp_path, truth_type, truths, labels):
    rows = [verl_row(p, t) for p, t in zip(PROBLEMS, truths, strict=True)]
    path = write_parquet(tmp_path / "x.parquet", rows, truth_type)
    assert [r["label"] for r in run(tmp_path, f"amc={path}")] == labels


def test_list_answers_are_alternatives_in_a_json_array(tmp_path, capsys):
    truths = [["0.01\n", "0.02\n"], ["4\n", "4"]]  # a duplicate after stripping is one answer
    rows = [verl_row(p, t) for p, t in zip(PROBLEMS, truths, strict=True)]
    path = write_parquet(tmp_path / "minerva.parquet", rows, pa.list_(pa.string()))
    out = run(tmp_path, f"minerva={path}")
    assert [r["label"] for r in out] == ['["0.01", "0.02"]', "4"]
    assert decode_alternatives(out[0]["label"]) == ["0.01", "0.02"]
    assert "minerva: 1 kept rows have a list of acceptable answers" in capsys.readouterr().out
    graded = grade_responses(
        ["</think>\\boxed{0.02}", "</think>\\boxed{0.03}"], [out[0]["label"]] * 2
    )
    assert [g.correct for g in graded] == [True, False]


def test_json_and_jsonl_forms_of_the_same_rows_give_the_same_file(tmp_path):
    rows = [verl_row(p, [t]) for p, t in zip(PROBLEMS, ["4", "6"], strict=True)]
    write_parquet(tmp_path / "a.parquet", rows, pa.list_(pa.string()))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    outs = [
        run(tmp_path, f"math500={tmp_path / name}", out_name=name + ".out")
        for name in ("a.parquet", "a.json", "a.jsonl")
    ]
    assert outs[0] == outs[1] == outs[2]
    assert [r["label"] for r in outs[0]] == ["4", "6"]


def test_minerva_answer_list_in_the_problem_answer_layout(tmp_path):
    path = tmp_path / "minerva.json"
    records = [{"problem": "p1", "answer": ["7.5 \\times 10^7", "7.5e7\n"]}]
    path.write_text(json.dumps(records))
    (row,) = run(tmp_path, f"minerva={path}")
    assert decode_alternatives(row["label"]) == ["7.5 \\times 10^7", "7.5e7"]
    assert row["prompt"] == "p1" + SUFFIX


def test_unknown_layout_is_an_error_naming_columns_found_and_looked_for(tmp_path, capsys):
    path = tmp_path / "odd.jsonl"
    path.write_text('{"query": "q", "gt": "1"}\n{"query": "r", "gt": "2"}\n')
    assert main(["--input", f"gsm8k={path}", "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no row has a layout drpo-data knows (2 rows read)" in err
    assert "looked for 'problem', 'question'" in err and "'reward_model.ground_truth'" in err
    assert "found 'query', 'gt'" in err
    assert not (tmp_path / "o").exists()


def test_messages_other_than_one_user_message_are_dropped_with_a_reason(tmp_path, capsys):
    row = verl_row(PROBLEMS[0], "4")
    row["prompt"] = [{"role": "system", "content": "Be brief."}, *row["prompt"]]
    good = verl_row(PROBLEMS[1], "6")
    path = write_parquet(tmp_path / "x.parquet", [row, good], pa.string())
    out = run(tmp_path, f"math500={path}")
    assert [r["label"] for r in out] == ["6"]
    assert "only a single user message is supported" in capsys.readouterr().err
