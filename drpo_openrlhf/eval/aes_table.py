"""AES tables of result files, laid out as the paper's (per dataset, then the average).

As in the paper, each run is scored against its own method's reference (the same method
trained without length penalty), unless one reference is imposed. The average column is
the AES of the dataset-averaged pass@1 and length, not the mean of the per-dataset AES:
that is how the paper's "Ave." column and its summary table relate (e.g. DRPO-1.5B,
lambda=0.1: per-dataset 0.662, 0.332, 0.098, -0.729, whose mean is 0.091, but Ave. 0.178).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from drpo_openrlhf.eval.metrics import aes, average_metrics
from drpo_openrlhf.eval.problems import AVERAGE

ROW_LABELS = ("name", "method", "param_name", "param", "reference")


def find_reference(run: Mapping, docs: Sequence[Mapping]) -> Mapping:
    """The single result with role ``reference`` and the run's method."""
    matches = [d for d in docs if d["role"] == "reference" and d["method"] == run["method"]]
    if len(matches) != 1:
        raise ValueError(
            f"{run['name']}: need exactly one reference result of method {run['method']!r}, "
            f"found {len(matches)} (give one with --reference)"
        )
    return matches[0]


def aes_rows(
    docs: Sequence[Mapping],
    *,
    reference: Mapping | None = None,
    datasets: Sequence[str] | None = None,
    alpha: float = 1.0,
    beta: float = 3.0,
    gamma: float = 10.0,
) -> list[dict[str, Any]]:
    """One row per ``run`` result: AES per dataset, ``average``, and the averaged pass@1 and
    length it is computed from. Datasets default to those both results have."""
    rows = []
    for run in (d for d in docs if d["role"] == "run"):
        ref = reference if reference is not None else find_reference(run, docs)
        names = datasets or [d for d in run["datasets"] if d in ref["datasets"]]
        missing = [d for d in names if d not in run["datasets"] or d not in ref["datasets"]]
        if missing or not names:
            raise ValueError(f"{run['name']} vs {ref['name']}: no shared datasets {missing}")
        row: dict[str, Any] = {key: run.get(key) for key in ROW_LABELS}
        row["reference"] = ref["name"]
        for name in names:
            m, r = run["datasets"][name], ref["datasets"][name]
            row[name] = aes(
                m["pass@1"], m["mean_length"], r["pass@1"], r["mean_length"], alpha, beta, gamma
            )
        m_avg = average_metrics({n: run["datasets"][n] for n in names})
        r_avg = average_metrics({n: ref["datasets"][n] for n in names})
        row[AVERAGE] = aes(
            m_avg["pass@1"],
            m_avg["mean_length"],
            r_avg["pass@1"],
            r_avg["mean_length"],
            alpha,
            beta,
            gamma,
        )
        row["pass@1"] = m_avg["pass@1"]
        row["mean_length"] = m_avg["mean_length"]
        rows.append(row)
    return rows


def _columns(rows: Sequence[Mapping]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    return columns


def format_table(rows: Sequence[Mapping]) -> str:
    """Plain-text table for the terminal (floats to 3 decimals, as in the paper)."""
    if not rows:
        return ""
    columns = _columns(rows)
    cells = [
        [
            f"{row.get(c):.3f}" if isinstance(row.get(c), float) else str(row.get(c, ""))
            for c in columns
        ]
        for row in rows
    ]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def write_rows(rows: Sequence[Mapping], path: str | Path) -> None:
    """CSV for a ``.csv`` path, JSON otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=_columns(rows))
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text(json.dumps(list(rows), indent=2) + "\n", encoding="utf-8")
