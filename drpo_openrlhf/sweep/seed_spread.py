"""The mean and range over seeds, the form of every number in the sweep's report."""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def spread(values: Iterable[float]) -> dict[str, float]:
    values = list(values)
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
