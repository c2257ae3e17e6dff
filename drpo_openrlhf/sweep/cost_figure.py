"""The report's cost figure: accuracy against the response tokens generated in training, one
curve per method, the seeds of a setting at their mean with min..max error bars (as the
frontier figure). Left: the sweep's final evaluation against the run's total tokens. Right,
when runs evaluated along the way: each setting's in-training pass@1 against the tokens spent
until each evaluation. Colours follow the frontier figure's (methods in the same order)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import fmean

from matplotlib import rcParams
from matplotlib.figure import Figure

Point = tuple[list[float], list[float]]  # the seeds' tokens and accuracies
LINE_STYLES = ("-", "--", ":", "-.")


def _draw(ax, x: list[float], y: list[float], color: str, **style) -> None:
    """Mean over seeds with the min..max range as error bars when the seeds differ."""
    mx, my = fmean(x), fmean(y)
    ax.plot([mx], [my], color=color, **style)
    if len(x) > 1:
        xerr = [[mx - min(x)], [max(x) - mx]]
        yerr = [[my - min(y)], [max(y) - my]]
        ax.errorbar([mx], [my], xerr=xerr, yerr=yerr, fmt="none", ecolor=color, capsize=2)


def _final_points(runs: Sequence[Mapping]) -> dict[str, dict[tuple, Point]]:
    """method -> (param, role, label) -> the seeds' (total tokens, final pass@1)."""
    curves: dict[str, dict[tuple, Point]] = {}
    for run in runs:
        if run["cost"] is None or run["cost"]["tokens"] is None:
            continue
        key = (run["param"], run["role"], run["label"])
        tokens, accuracy = curves.setdefault(run["method"], {}).setdefault(key, ([], []))
        tokens.append(run["cost"]["tokens"])
        accuracy.append(run["pass@1"])
    return curves


def _evaluation_points(members: Sequence[Mapping]) -> list[Point]:
    """A setting's in-training evaluations, per step that every seed evaluated."""
    by_step: list[dict[int, Mapping]] = [
        {p["step"]: p for p in run["cost"]["evaluations"] if p["tokens"] is not None}
        for run in members
    ]
    steps = sorted(set.intersection(*(set(s) for s in by_step)))
    return [([s[step]["tokens"] for s in by_step], [s[step]["pass@1"] for s in by_step])
            for step in steps]  # fmt: skip


def plot_cost(runs: Sequence[Mapping], output: str | Path | None = None) -> Figure:
    """``runs``: one mapping per trained run with ``method``, ``param``, ``role``, ``label``
    (the knob value to annotate), final ``pass@1`` and ``cost`` (``training_cost``)."""
    curves = _final_points(runs)
    palette = rcParams["axes.prop_cycle"].by_key()["color"]
    methods = list(dict.fromkeys(run["method"] for run in runs))
    colors = {m: palette[i % len(palette)] for i, m in enumerate(methods)}
    evaluated = [
        r for r in runs if r["cost"] and any(p["tokens"] for p in r["cost"]["evaluations"])
    ]
    figure = Figure(figsize=(4.6 * (1 + bool(evaluated)), 3.8), layout="constrained")
    axes = figure.subplots(1, 1 + bool(evaluated), squeeze=False).ravel()

    final = axes[0]
    for method, settings in curves.items():
        means = sorted(((fmean(t), fmean(a)) for t, a in settings.values()))
        final.plot([m[0] for m in means], [m[1] for m in means], color=colors[method], label=method)
        for (_, role, label), (tokens, accuracy) in settings.items():
            marker = {"marker": "s", "markersize": 8} if role == "reference" else {"marker": "o"}
            _draw(final, tokens, accuracy, colors[method], linestyle="none", **marker)
            final.annotate(label, (fmean(tokens), fmean(accuracy)), textcoords="offset points",
                           xytext=(4, 4), fontsize=7)  # fmt: skip
    final.set_title("final evaluation")
    final.set_ylabel("pass@1 (sweep's evaluation, average)")

    if evaluated:
        along = axes[1]
        settings: dict[tuple, list[Mapping]] = {}
        for run in evaluated:
            key = (run["method"], run["param"], run["role"], run["label"])
            settings.setdefault(key, []).append(run)
        drawn: dict[str, int] = {}  # settings of a method so far: their line styles differ
        for (method, _, role, label), members in settings.items():
            points = _evaluation_points(members)
            if not points:
                continue
            style = LINE_STYLES[drawn.get(method, 0) % len(LINE_STYLES)]
            drawn[method] = drawn.get(method, 0) + 1
            marker = "s" if role == "reference" else "o"
            along.plot([fmean(t) for t, _ in points], [fmean(a) for _, a in points],
                       color=colors[method], linestyle=style, marker=marker, markersize=4,
                       label=f"{method} {label}".strip())  # fmt: skip
            for tokens, accuracy in points:
                _draw(along, tokens, accuracy, colors[method], linestyle="none")
        along.set_title("in-training evaluations")
        along.set_ylabel("pass@1 (in-training evaluation)")
        along.legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("response tokens generated in training")
        ax.grid(alpha=0.3)
    final.legend(fontsize=7)
    if output is not None:
        figure.savefig(output, dpi=150)
    return figure
