"""Result files: one JSON document per evaluated model, and the same numbers as CSV rows."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from drpo_openrlhf.eval.metrics import LENGTH_KEYS, STYLE_KEYS, average_metrics
from drpo_openrlhf.eval.problems import AVERAGE

LABEL_COLUMNS = ("name", "model", "method", "param_name", "param", "role")
COUNT_COLUMNS = ("num_problems", "num_samples")
TAIL_COLUMNS = (*LENGTH_KEYS, *STYLE_KEYS, "truncation_rate")


def _pass_columns(doc: Mapping) -> list[str]:
    return [key for key in doc["average"] if key.startswith("pass@")]


def csv_columns(doc: Mapping) -> list[str]:
    return [*LABEL_COLUMNS, "dataset", *COUNT_COLUMNS, *_pass_columns(doc), *TAIL_COLUMNS]


def csv_rows(doc: Mapping) -> list[dict[str, Any]]:
    """One row per dataset, then the ``average`` row; missing values are empty cells."""
    columns = csv_columns(doc)
    blocks = [*doc["datasets"].items(), (AVERAGE, doc["average"])]
    rows = []
    for dataset, metrics in blocks:
        merged = {**doc, **metrics, "dataset": dataset}
        rows.append({c: "" if merged.get(c) is None else merged[c] for c in columns})
    return rows


def write_result(doc: Mapping, output_dir: str | Path) -> tuple[Path, Path]:
    """Writes ``<name>.json`` and ``<name>.csv`` and returns their paths."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path = output_dir / f"{doc['name']}.json"
    csv_path = output_dir / f"{doc['name']}.csv"
    json_path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    with csv_path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=csv_columns(doc))
        writer.writeheader()
        writer.writerows(csv_rows(doc))
    return json_path, csv_path


def load_results(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    return [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]


def select_metrics(doc: Mapping, panel: str, datasets: Sequence[str] | None = None) -> dict | None:
    """A result's metrics for one dataset, or for ``average``.

    With ``datasets`` given, the average is recomputed over those datasets (all must be in
    the result), e.g. to average over the paper's four sets when more were evaluated.
    Returns None when the result lacks the dataset.
    """
    if panel != AVERAGE:
        return doc["datasets"].get(panel)
    if datasets is None:
        return doc["average"]
    if not set(datasets) <= doc["datasets"].keys():
        return None
    return average_metrics({d: doc["datasets"][d] for d in datasets})
