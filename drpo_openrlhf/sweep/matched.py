"""A labelled variant of a method (e.g. DRPO with a lambda schedule) against that method's own
curve at the same average length, per panel and seed.

A schedule that changes lambda per prompt also moves the run along the frontier, so comparing
it with fixed lambda at the same lambda says little; the question is what it does at the same
cost in length. Per seed, the method's runs of that seed (DisCO included, the curve's end)
are sorted by their average length and interpolated linearly at the variant's average length;
per panel, the variant's pass@1 and length minus the curve's there. A variant longer or
shorter than every run of its curve has nothing to compare with and is named in the notes.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from drpo_openrlhf.eval.problems import AVERAGE
from drpo_openrlhf.eval.results import select_metrics
from drpo_openrlhf.sweep.seed_spread import spread
from drpo_openrlhf.sweep.spec import DISPLAY, Run

METRICS = ("pass@1", "mean_length")


def _interpolate(points: list[tuple[float, dict]], at: float) -> dict | None:
    """The metrics between the two points whose average lengths bracket ``at``."""
    points = sorted(points, key=lambda p: p[0])
    for (x0, low), (x1, high) in itertools.pairwise(points):
        if x0 <= at <= x1:
            t = 0.0 if x1 == x0 else (at - x0) / (x1 - x0)
            return {
                panel: {m: (1 - t) * low[panel][m] + t * high[panel][m] for m in METRICS}
                for panel in low
            }
    return None


def matched_length_rows(
    runs: Sequence[Run],
    docs: Sequence[Mapping],
    panels: Sequence[str],
    datasets: Sequence[str] | None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Per variant setting: the seeds compared and, per panel, the differences in pass@1 and
    length against its method's curve (mean and range over seeds); and the notes."""

    def metrics(doc: Mapping) -> dict | None:
        found = {p: select_metrics(doc, p, datasets) for p in panels}
        return found if all(found.values()) else None

    by_name = {doc["name"]: doc for doc in docs}
    deltas: dict[tuple[str, str | None, str | None], list[tuple[int | None, dict]]] = {}
    notes = []
    for run in runs:
        variant = by_name.get(run.name)
        if run.label is None or variant is None or metrics(variant) is None:
            continue
        curve = [
            (found[AVERAGE]["mean_length"], found)
            for other in runs
            if other.label is None
            and other.seed == run.seed
            and DISPLAY.get(other.method) == DISPLAY[run.method]
            and other.name in by_name
            and (found := metrics(by_name[other.name]))
        ]
        mine = metrics(variant)
        matched = _interpolate(curve, mine[AVERAGE]["mean_length"])
        if matched is None:
            notes.append(
                f"{run.name}: average length {mine[AVERAGE]['mean_length']:.1f} is outside "
                f"its seed's {DISPLAY[run.method]} curve ({len(curve)} runs): not compared"
            )
            continue
        delta = {p: {m: mine[p][m] - matched[p][m] for m in METRICS} for p in panels}
        deltas.setdefault((run.label, run.param_name, run.param), []).append((run.seed, delta))
    rows = []
    for (label, param_name, param), members in deltas.items():
        rows.append(
            {
                "method": label,
                "param_name": param_name,
                "param": param,
                "seeds": [seed for seed, _ in members],
                "panels": {
                    p: {m: spread(d[p][m] for _, d in members) for m in METRICS} for p in panels
                },
            }
        )
    return rows, notes
