"""``drpo-data`` end to end via ``main([...])``: files, summary, exit codes, OpenRLHF reading."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from drpo_openrlhf.data.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "data"
MATH_FIXTURES = {
    "deepscaler": "deepscaler.json",
    "gsm8k": "gsm8k.jsonl",
    "math500": "math500.jsonl",
    "olympiadbench": "olympiadbench.jsonl",
    "aime2024": "aime2024.jsonl",
    "aime2025": "aime2025.jsonl",
    "amc": "amc.jsonl",
    "minerva": "minerva.jsonl",
}
EXPECTED_ROWS = {
    "deepscaler": 4,
    "gsm8k": 3,
    "math500": 3,
    "olympiadbench": 3,
    "aime2024": 2,
    "aime2025": 2,
    "amc": 3,
    "minerva": 2,
    "kk-train": 2,
    "kk-test": 2,
}


def _all_inputs() -> list[str]:
    args = []
    for name, fixture in MATH_FIXTURES.items():
        args += ["--input", f"{name}={FIXTURES / fixture}"]
    for split in ("train", "test"):
        args += ["--input", f"kk-{split}={FIXTURES / 'kk' / split}"]
    return args


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    assert main([*_all_inputs(), "--out-dir", str(out), "--no-progress"]) == 0
    return out


def test_every_source_is_written_with_exactly_the_three_fields(prepared_dir):
    assert sorted(p.name for p in prepared_dir.iterdir()) == sorted(
        f"{name}.jsonl" for name in EXPECTED_ROWS
    )
    for name, count in EXPECTED_ROWS.items():
        rows = _read_jsonl(prepared_dir / f"{name}.jsonl")
        assert len(rows) == count, name
        for row in rows:
            assert list(row) == ["prompt", "label", "datasource"]
            assert all(isinstance(value, str) and value for value in row.values())
    kk = _read_jsonl(prepared_dir / "kk-test.jsonl")
    assert [row["datasource"] for row in kk] == ["kk_2ppl", "kk_3ppl"]
    assert kk[0]["label"] == "(1) Zoey is a knight\n(2) Oliver is a knave"


def test_summary_counts_every_source(tmp_path, capsys):
    assert main([*_all_inputs(), "--out-dir", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["source", "read", "kept", "dropped", "excluded", "warnings", "output"]
    table = {line.split()[0]: line.split()[1:] for line in out[1:11]}
    assert table["kk-train"] == ["3", "2", "0", "1", "0", str(tmp_path / "kk-train.jsonl")]
    assert table["gsm8k"] == ["3", "3", "0", "0", "0", str(tmp_path / "gsm8k.jsonl")]
    assert "kk-train: excluded: 2-person puzzle outside 3-7 (1)" in out


def test_openrlhf_reads_the_files(prepared_dir, monkeypatch, tmp_path):
    import datasets
    from openrlhf.datasets.prompts_dataset import PromptDataset
    from openrlhf.datasets.utils import blending_datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    data_args = SimpleNamespace(input_key="prompt", label_key="label", apply_chat_template=False)
    strategy = SimpleNamespace(
        args=SimpleNamespace(data=data_args, use_ms=False),
        print=lambda *args: None,
        is_rank_0=lambda: True,
    )
    names = ["aime2024", "amc", "kk-test"]  # int, float and K&K labels concatenate as strings
    files = ",".join(str(prepared_dir / f"{name}.jsonl") for name in names)
    dataset = PromptDataset(blending_datasets(files, None, strategy), None, strategy)
    expected = [row for name in names for row in _read_jsonl(prepared_dir / f"{name}.jsonl")]
    items = [dataset[i] for i in range(len(dataset))]
    assert [(ds, prompt, label) for ds, prompt, label, _ in items] == [
        (row["datasource"], row["prompt"], row["label"]) for row in expected
    ]


def _fake_hub(monkeypatch) -> list[tuple]:
    """Serve the fixtures as if they came from the Hub, keyed by the real ids and splits."""
    import datasets

    by_repo = {source: FIXTURES / fixture for source, fixture in MATH_FIXTURES.items()}
    repos = {
        "agentica-org/DeepScaleR-Preview-Dataset": by_repo["deepscaler"],
        "openai/gsm8k": by_repo["gsm8k"],
        "HuggingFaceH4/MATH-500": by_repo["math500"],
        "Hothan/OlympiadBench": by_repo["olympiadbench"],
        "HuggingFaceH4/aime_2024": by_repo["aime2024"],
        "MathArena/aime_2025": by_repo["aime2025"],
        "AI-MO/aimo-validation-amc": by_repo["amc"],
        "math-ai/minervamath": by_repo["minerva"],
    }
    calls = []

    def load_dataset(repo, config, split):
        calls.append((repo, config, split))
        if repo == "K-and-K/knights-and-knaves":
            files = sorted((FIXTURES / "kk" / config).glob(f"people{split[:-3]}_*.jsonl"))
        else:
            files = [repos[repo]]
        rows = []
        for file in files:
            text = file.read_text()
            rows += json.loads(text) if file.suffix == ".json" else _read_jsonl(file)
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_hub_path_gives_the_same_files_as_local_files(prepared_dir, monkeypatch, tmp_path):
    calls = _fake_hub(monkeypatch)
    assert main(["all", "--out-dir", str(tmp_path), "--no-progress"]) == 0
    for name in EXPECTED_ROWS:
        assert _read_jsonl(tmp_path / f"{name}.jsonl") == _read_jsonl(
            prepared_dir / f"{name}.jsonl"
        )
    assert ("openai/gsm8k", "main", "test") in calls
    assert ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train") in calls
    kk_train = [split for repo, config, split in calls if config == "train" and "K-and-K" in repo]
    assert kk_train == ["3ppl", "4ppl", "5ppl", "6ppl", "7ppl"]


def test_groups_and_inputs_combine(monkeypatch, tmp_path):
    calls = _fake_hub(monkeypatch)
    argv = ["kk", "--input", f"kk-train={FIXTURES / 'kk' / 'train'}", "--out-dir", str(tmp_path)]
    assert main([*argv, "--kk-test-people", "3"]) == 0
    assert calls == [("K-and-K/knights-and-knaves", "test", "3ppl")]
    assert [row["datasource"] for row in _read_jsonl(tmp_path / "kk-test.jsonl")] == ["kk_3ppl"]
    assert (tmp_path / "kk-train.jsonl").exists()


def test_hub_failure_exits_2_with_local_file_advice(monkeypatch, tmp_path, capsys):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert main(["gsm8k", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: cannot load gsm8k from the Hugging Face Hub: openai/gsm8k (main/test)" in err
    assert "--input gsm8k=PATH" in err
    assert not list(tmp_path.iterdir())


def test_issues_are_printed_with_file_and_line_and_reported_as_json(tmp_path, capsys):
    bad = FIXTURES / "bad" / "math_rows.jsonl"
    report = tmp_path / "report.json"
    argv = ["--input", f"deepscaler={bad}", "--out-dir", str(tmp_path), "--report", str(report)]
    assert main([*argv, "--show-issues", "3"]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[:3] == [
        f"{bad} line 2: missing: problem is missing (looked for 'problem', 'question', "
        "'Problem', 'Question', or a chat-message list 'prompt' with "
        "'reward_model.ground_truth' (verl); found 'answer') [dropped]",
        f"{bad} line 3: empty: problem field 'problem' is empty [dropped]",
        f"{bad} line 4: wrong_type: problem field 'problem' is int, expected a string [dropped]",
    ]
    assert err[3] == "... and 9 more issues in deepscaler (--report FILE lists all)"
    assert "deepscaler: dropped: empty (2), invalid_json (1), missing (2), wrong_type (4)" in (
        captured.out
    )
    assert "deepscaler: kept with warnings: duplicate (2), unparsable_answer (1)" in captured.out
    data = json.loads(report.read_text())
    assert data["sources"]["deepscaler"] == {
        "read": 13,
        "kept": 4,
        "dropped": {"missing": 2, "empty": 2, "wrong_type": 4, "invalid_json": 1},
        "warnings": {"duplicate": 2, "unparsable_answer": 1},
        "excluded": {},
        "list_labels": 0,
        "output": str(tmp_path / "deepscaler.jsonl"),
    }
    assert len(data["issues"]) == 12
    counts = data["sources"]["deepscaler"]
    assert counts["read"] == counts["kept"] + sum(counts["dropped"].values())  # none unaccounted
    assert data["issues"][0]["location"] == f"{bad} line 2"
    assert len(_read_jsonl(tmp_path / "deepscaler.jsonl")) == 4


def test_drop_options_change_what_is_written(tmp_path):
    bad = FIXTURES / "bad" / "math_rows.jsonl"
    argv = ["--input", f"deepscaler={bad}", "--out-dir", str(tmp_path)]
    assert main([*argv, "--drop-duplicates", "--drop-unparsable"]) == 0
    assert [row["label"] for row in _read_jsonl(tmp_path / "deepscaler.jsonl")] == ["4"]


def test_strict_mode_fails_on_any_issue_and_writes_nothing(tmp_path, capsys):
    bad = FIXTURES / "bad" / "gsm8k_rows.jsonl"
    out = tmp_path / "out"
    argv = ["--input", f"gsm8k={bad}", "--input", f"amc={FIXTURES / 'amc.jsonl'}"]
    assert main([*argv, "--out-dir", str(out), "--strict"]) == 1
    err = capsys.readouterr().err
    assert f"{bad} line 1: bad_format" in err
    assert "error: --strict: 2 issue(s) found; no file written" in err
    assert not out.exists()
    assert main([*argv[2:], "--out-dir", str(out), "--strict"]) == 0  # clean input passes
    assert (out / "amc.jsonl").exists()


def test_source_with_no_usable_row_fails(tmp_path, capsys):
    bad = FIXTURES / "bad" / "kk_rows.jsonl"
    assert main(["--input", f"kk-test={bad}", "--out-dir", str(tmp_path)]) == 1
    assert "error: no usable row in kk-test" in capsys.readouterr().err
    assert not (tmp_path / "kk-test.jsonl").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["nosuch"], "unknown source 'nosuch'"),
        ([], "name at least one source"),
        (["--input", "gsm8k"], "expected NAME=PATH"),
        (["--input", "nosuch=x.jsonl"], "--input names unknown source(s) ['nosuch']"),
        (["--input", "gsm8k=does/not/exist.jsonl"], "not found: does/not/exist.jsonl"),
        (["kk", "--kk-train-people", "7-3"], "expected 1 <= N <= M"),
        (["gsm8k", "--show-issues", "-1"], "--show-issues must be >= 0"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_lists_sources_with_hub_ids():
    result = subprocess.run(
        [sys.executable, "-m", "drpo_openrlhf.data", "--list"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "gsm8k" in result.stdout and "hub: openai/gsm8k [main] test" in result.stdout
    assert "hub: K-and-K/knights-and-knaves [test] 2ppl,3ppl" in result.stdout
