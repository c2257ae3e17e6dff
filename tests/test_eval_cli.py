"""The drpo-eval command line: result schema (JSON/CSV), resume, plot and aes commands."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from time_bounds import scaled

from drpo_openrlhf.eval import generation
from drpo_openrlhf.eval.cli import default_name, main
from drpo_openrlhf.eval.metrics import average_metrics
from drpo_openrlhf.models.tiny import build_tiny_model

FIXTURE = Path(__file__).parent / "fixtures" / "eval" / "problems.jsonl"
GRADER_MODULE = """
from types import SimpleNamespace

def grade(responses, labels, require_think_end=True):
    return [SimpleNamespace(correct=any(c.isdigit() for c in r), reason="digit") for r in responses]
"""
METRIC_KEYS = [
    "num_problems",
    "num_samples",
    "pass@1",
    "pass@2",
    "mean_length",
    "mean_length_correct",
    "mean_length_incorrect",
    "mean_reflections",
    "mean_reflections_correct",
    "mean_restated_answers",
    "mean_restated_answers_correct",
    "truncation_rate",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture
def grader_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "digit_grader.py").write_text(GRADER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "digit_grader:grade"


def run_args(tiny: str, out: Path, grader: str) -> list[str]:
    return [
        "--model", tiny, "--data", str(FIXTURE), "--output-dir", str(out),
        "--backend", "hf", "--batch-size", "4", "--n", "2", "--max-new-tokens", "6",
        "--k", "2", "--grader", grader, "--no-progress",
        "--method", "DRPO", "--param-name", "lambda", "--param", "0.1",
    ]  # fmt: skip


def test_run_writes_result_json_and_csv(tiny, grader_on_path, tmp_path, capsys) -> None:
    out = tmp_path / "results"
    assert main(run_args(tiny, out, grader_on_path)) == 0
    printed = capsys.readouterr().out
    assert "DRPO-0.1: pass@1" in printed
    # the tiny model's ChatML template: plain answers (--answer-format auto)
    assert f"{tiny}: answer format: plain (the generation prompt of chat_template.jinja" in printed

    doc = json.loads((out / "DRPO-0.1.json").read_text())
    assert list(doc) == [
        "schema_version", "name", "method", "param", "param_name", "role",
        "model", "settings", "datasets", "average",
    ]  # fmt: skip
    assert (doc["name"], doc["method"], doc["param"], doc["param_name"], doc["role"]) == (
        "DRPO-0.1", "DRPO", "0.1", "lambda", "run",
    )  # fmt: skip
    assert doc["settings"] == {
        "n": 2, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 6, "seed": 0,
        "backend": "hf", "dtype": "auto", "ks": [1, 2],
        "grader": {"function": grader_on_path, "require_think_end": False},
    }  # fmt: skip
    assert list(doc["datasets"]) == ["arith_easy", "fractions"]
    for metrics in doc["datasets"].values():
        assert list(metrics) == [*METRIC_KEYS, "reasons"]
        assert sum(metrics["reasons"].values()) == metrics["num_samples"]
    assert list(doc["average"]) == ["num_datasets", *METRIC_KEYS]
    assert doc["average"]["pass@1"] == pytest.approx(average_metrics(doc["datasets"])["pass@1"])

    with (out / "DRPO-0.1.csv").open(newline="") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
    assert reader.fieldnames == [
        "name", "model", "method", "param_name", "param", "role", "dataset", *METRIC_KEYS,
    ]  # fmt: skip
    assert [r["dataset"] for r in rows] == ["arith_easy", "fractions", "average"]
    for row in rows:
        block = doc["average"] if row["dataset"] == "average" else doc["datasets"][row["dataset"]]
        for key in METRIC_KEYS:
            expected = block[key]
            assert (
                row[key] == "" if expected is None else float(row[key]) == pytest.approx(expected)
            )
        assert row["model"] == tiny and row["param"] == "0.1"


def test_rerun_reads_the_cache(tiny, grader_on_path, tmp_path, monkeypatch) -> None:
    out = tmp_path / "results"
    main(run_args(tiny, out, grader_on_path))
    first = (out / "DRPO-0.1.json").read_text()

    class NoModel:
        def __init__(self, *args, **kwargs) -> None:
            raise AssertionError("model loaded although every generation is cached")

    monkeypatch.setattr(generation, "HFBackend", NoModel)
    main(run_args(tiny, out, grader_on_path))
    assert (out / "DRPO-0.1.json").read_text() == first
    with pytest.raises(AssertionError, match="cached"):
        main([*run_args(tiny, out, grader_on_path), "--seed", "1"])


def test_labels_per_model(tiny: str, tmp_path: Path) -> None:
    base = ["--model", tiny, "--model", tiny, "--data", str(FIXTURE), "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="--param given 1 times for 2 models"):
        main([*base, "--method", "DRPO", "--param", "0.1"])
    with pytest.raises(SystemExit, match="collide"):
        main(base)
    assert default_name("ckpt/drpo_lambda0.1/", None, None) == "drpo_lambda0.1"
    assert default_name("x", "DRPO", "0.1") == "DRPO-0.1"
    assert default_name("x", "RLOO LP", None) == "RLOO_LP"


def write_result(path: Path, name: str, method: str | None, param: str | None, role: str,
                 per_dataset: dict[str, tuple[float, float]]) -> Path:  # fmt: skip
    datasets = {
        d: {"num_problems": 4, "num_samples": 8, "pass@1": acc, "mean_length": length}
        for d, (acc, length) in per_dataset.items()
    }
    doc = {
        "schema_version": 1, "name": name, "method": method, "param": param,
        "param_name": "lambda", "role": role, "model": name, "settings": {},
        "datasets": datasets, "average": average_metrics(datasets),
    }  # fmt: skip
    path.write_text(json.dumps(doc))
    return path


def test_plot_and_aes_commands(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    files = [
        write_result(tmp_path / "a.json", "disco", "DRPO", "inf", "reference",
                     {"gsm8k": (0.8, 1000), "aime": (0.3, 6000)}),
        write_result(tmp_path / "b.json", "drpo-0.1", "DRPO", "0.1", "run",
                     {"gsm8k": (0.8, 500), "aime": (0.27, 5000)}),
        write_result(tmp_path / "c.json", "base", None, None, "base",
                     {"gsm8k": (0.7, 1500), "aime": (0.2, 7000)}),
    ]  # fmt: skip
    png = tmp_path / "fig" / "tradeoff.png"
    png.parent.mkdir()
    assert main(["plot", *map(str, files), "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"

    assert main(["aes", *map(str, files), "-o", str(tmp_path / "aes.csv")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2].split()[:2] == ["name", "method"] and printed[-1].startswith("drpo-0.1")
    with (tmp_path / "aes.csv").open() as handle:
        (row,) = list(csv.DictReader(handle))
    assert float(row["gsm8k"]) == pytest.approx(0.5)
    assert float(row["aime"]) == pytest.approx(1 / 6 - 10 * 0.1)
    assert float(row["average"]) == pytest.approx(1 - 2750 / 3500 - 10 * 0.015 / 0.55)

    assert main(["aes", str(files[1]), "--reference", str(files[2]), "--datasets", "gsm8k"]) == 0
    last = capsys.readouterr().out.splitlines()[-1].split()
    assert last[4] == "base" and float(last[5]) == pytest.approx(
        1000 / 1500 + 3 * 0.1 / 0.7, abs=1e-3
    )


def test_module_entry_point() -> None:
    for args in ([], ["plot"], ["aes"]):
        done = subprocess.run(
            [sys.executable, "-m", "drpo_openrlhf.eval", *args, "--help"],
            capture_output=True,
            text=True,
            timeout=scaled(120),  # a hang guard: the three took 1.4 s (2 cores at load 4-7)
        )
        assert done.returncode == 0, done.stderr
        assert ("--model" in done.stdout) == (args == [])
        assert "usage: drpo-eval" in done.stdout
