"""The paper's performance/length trade-off figure from result files.

One panel for the dataset average, then one per dataset. In each, every method is a curve
of pass@1 against mean response length over its runs (sorted by length, points annotated
with the knob value; the seeds of one setting at their mean, with their spread as error
bars), its no-length-penalty reference (role ``reference``) is also drawn as
a square, and each base model (role ``base``) is a grey horizontal line whose legend entry
gives its length. The figure is built without pyplot (no global backend state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import fmean

from matplotlib import rcParams
from matplotlib.figure import Figure

from drpo_openrlhf.eval.problems import AVERAGE
from drpo_openrlhf.eval.results import select_metrics


def _panels(docs: Sequence[Mapping], datasets: Sequence[str] | None) -> list[str]:
    if datasets is not None:
        return [AVERAGE, *datasets]
    names: list[str] = []
    for doc in docs:
        names.extend(d for d in doc["datasets"] if d not in names)
    return [AVERAGE, *names]


def point_label(doc: Mapping) -> str:
    if doc.get("param") is None:
        return ""
    return f"{doc['param_name']}={doc['param']}" if doc.get("param_name") else str(doc["param"])


def _method(doc: Mapping) -> str:
    return doc.get("method") or doc["name"]


def _points(
    members: Sequence[Mapping], panel: str, datasets: Sequence[str] | None, metric: str
) -> list[tuple[float, float, Mapping, tuple[list[float], list[float]]]]:
    """One point per setting of a curve: results that share method, knob value and role
    (the seeds of one setting) are drawn at their mean, with their lengths and metric values
    for the error bars (the seed spread, min to max)."""
    groups: dict[tuple, list[tuple[float, float, Mapping]]] = {}
    for doc in members:
        metrics = select_metrics(doc, panel, datasets)
        if metrics:
            key = (doc.get("param"), doc["role"])
            groups.setdefault(key, []).append((metrics["mean_length"], metrics[metric], doc))
    return [
        (fmean(g[0] for g in group), fmean(g[1] for g in group), group[0][2],
         ([g[0] for g in group], [g[1] for g in group]))
        for group in groups.values()
    ]  # fmt: skip


def _draw_panel(
    ax,
    panel: str,
    curves: Mapping[str, Sequence[Mapping]],
    bases: Sequence[Mapping],
    colors: Mapping[str, str],
    datasets: Sequence[str] | None,
    metric: str,
) -> None:
    for method, members in curves.items():
        points = _points(members, panel, datasets, metric)
        if not points:
            continue
        points.sort(key=lambda p: p[0])
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            color=colors[method],
            label=method,
        )
        for x, y, doc, (xs, ys) in points:
            ax.annotate(
                point_label(doc), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
            if len(xs) > 1:
                ax.errorbar(
                    [x],
                    [y],
                    xerr=[[x - min(xs)], [max(xs) - x]],
                    yerr=[[y - min(ys)], [max(ys) - y]],
                    fmt="none",
                    ecolor=colors[method],
                    capsize=2,
                )
            if doc["role"] == "reference":
                ax.plot(
                    [x],
                    [y],
                    marker="s",
                    markersize=9,
                    linestyle="none",
                    color=colors[method],
                    label=f"{method} (no length penalty)",
                )
    for doc in bases:
        metrics = select_metrics(doc, panel, datasets)
        if metrics:
            ax.axhline(
                metrics[metric],
                color="grey",
                linestyle="--",
                label=f"{doc['name']} (base, length {metrics['mean_length']:.0f})",
            )
    ax.set_title(panel)
    ax.set_xlabel("mean response length (tokens)")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)


def plot_tradeoff(
    docs: Sequence[Mapping],
    output: str | Path | None = None,
    *,
    datasets: Sequence[str] | None = None,
    metric: str = "pass@1",
) -> Figure:
    """Draws the trade-off figure (and saves it as PNG when ``output`` is given)."""
    curves: dict[str, list[Mapping]] = {}
    bases = []
    for doc in docs:
        if doc["role"] == "base":
            bases.append(doc)
        else:
            curves.setdefault(_method(doc), []).append(doc)
    palette = rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {m: palette[i % len(palette)] for i, m in enumerate(curves)}

    panels = _panels(docs, datasets)
    columns = min(len(panels), 4)
    rows = -(-len(panels) // columns)
    figure = Figure(figsize=(4.2 * columns, 3.6 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes, panels, strict=False):
        _draw_panel(ax, panel, curves, bases, colors, datasets, metric)
    axes[0].legend(fontsize=7)
    if output is not None:
        figure.savefig(output, dpi=150)
    return figure
