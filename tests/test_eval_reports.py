"""AES tables and the trade-off figure, from synthetic result documents."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from drpo_openrlhf.eval import aes
from drpo_openrlhf.eval.aes_table import aes_rows, format_table, write_rows
from drpo_openrlhf.eval.metrics import average_metrics
from drpo_openrlhf.eval.plot import plot_tradeoff
from drpo_openrlhf.eval.results import select_metrics


def result(name, method, param, role, per_dataset: dict[str, tuple[float, float]]) -> dict:
    """A result document with the runner's schema; ``per_dataset``: (pass@1, length)."""
    datasets = {
        d: {
            "num_problems": 10,
            "num_samples": 160,
            "pass@1": acc,
            "pass@16": min(1.0, acc + 0.2),
            "mean_length": length,
            "mean_length_correct": length * 0.8,
            "mean_length_incorrect": length * 1.5,
            "truncation_rate": 0.01,
        }
        for d, (acc, length) in per_dataset.items()
    }
    return {
        "schema_version": 1,
        "name": name,
        "method": method,
        "param": param,
        "param_name": "lambda" if method == "DRPO" else "alpha",
        "role": role,
        "model": f"models/{name}",
        "settings": {},
        "datasets": datasets,
        "average": average_metrics(datasets),
    }


@pytest.fixture
def docs() -> list[dict]:
    return [
        result("disco", "DRPO", "inf", "reference", {"gsm8k": (0.80, 1500), "aime": (0.30, 7000)}),
        result("drpo-0.5", "DRPO", "0.5", "run", {"gsm8k": (0.82, 900), "aime": (0.28, 6000)}),
        result("drpo-0.1", "DRPO", "0.1", "run", {"gsm8k": (0.79, 400), "aime": (0.30, 5000)}),
        result(
            "rloo-0", "RLOO-LP", "0", "reference", {"gsm8k": (0.78, 1400), "aime": (0.31, 6800)}
        ),
        result("rloo-0.2", "RLOO-LP", "0.2", "run", {"gsm8k": (0.70, 700), "aime": (0.25, 5500)}),
        result("base", None, None, "base", {"gsm8k": (0.75, 2000), "aime": (0.25, 8000)}),
    ]


def test_aes_rows_per_dataset_and_average(docs: list[dict]) -> None:
    rows = {row["name"]: row for row in aes_rows(docs)}
    assert set(rows) == {"drpo-0.5", "drpo-0.1", "rloo-0.2"}  # only role "run"
    drpo = rows["drpo-0.1"]
    assert drpo["reference"] == "disco"  # its own method's reference
    # gsm8k: dL = 1100/1500, dA = -0.01/0.8 (down, gamma); aime: dL = 2000/7000, dA = 0 (beta).
    assert drpo["gsm8k"] == pytest.approx(1100 / 1500 - 10 * 0.01 / 0.80)
    assert drpo["aime"] == pytest.approx(2000 / 7000)
    # The average is the AES of averaged pass@1 and length, not the mean of the AES values.
    assert drpo["pass@1"] == pytest.approx((0.79 + 0.30) / 2)
    assert drpo["mean_length"] == pytest.approx((400 + 5000) / 2)
    assert drpo["average"] == pytest.approx(aes(0.545, 2700, 0.55, 4250))
    assert drpo["average"] != pytest.approx((drpo["gsm8k"] + drpo["aime"]) / 2)
    assert rows["rloo-0.2"]["reference"] == "rloo-0"
    assert rows["rloo-0.2"]["gsm8k"] == pytest.approx(1 - 700 / 1400 - 10 * 0.08 / 0.78)


def test_aes_rows_with_imposed_reference_datasets_and_weights(docs: list[dict]) -> None:
    rows = aes_rows(docs, reference=docs[-1], datasets=["aime"], alpha=2, beta=1, gamma=5)
    first = rows[0]
    assert first["reference"] == "base" and "gsm8k" not in first
    assert first["aime"] == pytest.approx(2 * (8000 - 6000) / 8000 + 1 * 0.03 / 0.25)
    assert first["average"] == pytest.approx(first["aime"])


def test_aes_rows_need_a_unique_reference(docs: list[dict]) -> None:
    with pytest.raises(ValueError, match="exactly one reference"):
        aes_rows([d for d in docs if d["name"] != "disco"])
    with pytest.raises(ValueError, match="exactly one reference"):
        aes_rows([*docs, {**docs[0], "name": "disco-2"}])
    with pytest.raises(ValueError, match="shared"):
        aes_rows(docs, datasets=["math500"])


def test_aes_table_output(docs: list[dict], tmp_path: Path) -> None:
    rows = aes_rows(docs)
    text = format_table(rows).splitlines()
    assert text[0].split()[:5] == ["name", "method", "param_name", "param", "reference"]
    assert len(text) == 1 + len(rows)
    assert f"{rows[0]['average']:.3f}" in text[1]
    write_rows(rows, tmp_path / "aes.csv")
    with (tmp_path / "aes.csv").open() as handle:
        read = list(csv.DictReader(handle))
    assert [r["name"] for r in read] == [r["name"] for r in rows]
    assert float(read[0]["average"]) == pytest.approx(rows[0]["average"])
    write_rows(rows, tmp_path / "aes.json")
    assert json.loads((tmp_path / "aes.json").read_text()) == rows


def test_select_metrics_recomputes_the_average(docs: list[dict]) -> None:
    drpo = docs[1]
    assert select_metrics(drpo, "average") == drpo["average"]
    assert select_metrics(drpo, "aime")["pass@1"] == 0.28
    assert select_metrics(drpo, "average", ["aime"])["pass@1"] == 0.28
    assert select_metrics(drpo, "average", ["aime", "math500"]) is None
    assert select_metrics(drpo, "math500") is None


def test_tradeoff_figure(docs: list[dict], tmp_path: Path) -> None:
    output = tmp_path / "tradeoff.png"
    figure = plot_tradeoff(docs, output)
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 10_000
    axes = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["average", "gsm8k", "aime"]
    for ax in axes:
        labels = [line.get_label() for line in ax.get_lines()]
        # Two method curves, one square per reference, one base line.
        assert labels == [
            "DRPO",
            "DRPO (no length penalty)",
            "RLOO-LP",
            "RLOO-LP (no length penalty)",
            "base (base, length " + labels[-1].split("length ")[1],
        ]
    gsm8k = axes[1]
    drpo_curve = gsm8k.get_lines()[0]
    assert list(drpo_curve.get_xdata()) == [400, 900, 1500]  # sorted by length
    assert list(drpo_curve.get_ydata()) == [0.79, 0.82, 0.80]
    assert gsm8k.get_lines()[-1].get_ydata()[0] == 0.75
    annotations = {t.get_text() for t in gsm8k.texts}
    assert {"lambda=0.1", "lambda=0.5", "lambda=inf", "alpha=0.2"} <= annotations
    legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert legend[-1] == "base (base, length 5000)"


def test_tradeoff_figure_dataset_selection(docs: list[dict], tmp_path: Path) -> None:
    figure = plot_tradeoff(docs[:3], datasets=["aime"])
    axes = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["average", "aime"]
    average_curve = axes[0].get_lines()[0]
    assert sorted(average_curve.get_ydata()) == [0.28, 0.30, 0.30]  # the aime-only average
    assert len(axes[0].get_lines()) == 2  # one method and its reference, no base
