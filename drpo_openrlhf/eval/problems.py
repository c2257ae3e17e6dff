"""Reading prepared evaluation data: JSONL rows ``{"prompt", "label", "datasource"}``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Name of the across-datasets row in results; no dataset may take it.
AVERAGE = "average"


@dataclass(frozen=True)
class Problem:
    """``prompt`` is the user turn, used verbatim; ``label`` the reference answer."""

    prompt: str
    label: str


def load_problems(
    paths: Sequence[str | Path], limit: int | None = None
) -> dict[str, list[Problem]]:
    """Problems grouped by ``datasource``, datasets in order of first appearance.

    One file may hold several datasets and one dataset may span files. A row without
    ``datasource`` belongs to a dataset named after its file. ``limit`` keeps the first
    problems of each dataset (quick looks and demos).
    """
    datasets: dict[str, list[Problem]] = {}
    for path in map(Path, paths):
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                missing = {"prompt", "label"} - row.keys()
                if missing:
                    raise ValueError(f"{path}:{line_number}: missing {sorted(missing)}")
                name = str(row.get("datasource") or path.stem)
                if name == AVERAGE:
                    raise ValueError(f"{path}:{line_number}: {AVERAGE!r} is a reserved name")
                datasets.setdefault(name, []).append(Problem(row["prompt"], str(row["label"])))
    if limit is not None:
        datasets = {name: problems[:limit] for name, problems in datasets.items()}
    return datasets
