"""The sweep's one report, from the finished runs: the frontiers (pass@1 against mean length
per dataset and averaged, one curve per method, seed spread as error bars; drpo-eval's
figure), the AES table against DisCO of the same seed (drpo-eval's AES rows, then the mean
and range over seeds), labelled variants against their method's curve at the same length
(``matched.py``), the pushed-down share per run, and what each run cost to train
(``cost``: tokens, time and its phases, tokens and time to DisCO's accuracy; accuracy against
training tokens in ``cost.png``); as PNG, Markdown and JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from drpo_openrlhf.eval.aes_table import aes_rows
from drpo_openrlhf.eval.plot import plot_tradeoff, point_label
from drpo_openrlhf.eval.problems import AVERAGE
from drpo_openrlhf.eval.results import load_results, select_metrics
from drpo_openrlhf.sweep import state
from drpo_openrlhf.sweep.cost import cost_entry, cost_markdown, cost_rows, disco_targets, run_cost
from drpo_openrlhf.sweep.cost_figure import plot_cost
from drpo_openrlhf.sweep.matched import matched_length_rows
from drpo_openrlhf.sweep.seed_spread import spread
from drpo_openrlhf.sweep.spec import Run, Sweep


def _point(doc: Mapping) -> tuple[str, str | None, str]:
    """What seeds of one setting share: the curve, the knob value, the role."""
    return (doc.get("method") or doc["name"], doc.get("param"), doc["role"])


def frontier_rows(
    docs: Sequence[Mapping],
    seeds: Mapping[str, int | None],
    panels: list[str],
    datasets: Sequence[str] | None,
) -> list[dict[str, Any]]:
    """Per method and knob value, per panel: pass@1 and mean length over the seeds."""
    groups: dict[tuple, list[Mapping]] = {}
    for doc in docs:
        groups.setdefault(_point(doc), []).append(doc)
    rows = []
    for (method, param, role), members in groups.items():
        row: dict[str, Any] = {
            "method": method,
            "param_name": members[0].get("param_name"),
            "param": param,
            "role": role,
            "seeds": [seeds[d["name"]] for d in members],
            "panels": {},
        }
        for panel in panels:
            found = [m for d in members if (m := select_metrics(d, panel, datasets))]
            if found:
                row["panels"][panel] = {
                    "pass@1": spread(m["pass@1"] for m in found),
                    "mean_length": spread(m["mean_length"] for m in found),
                }
        rows.append(row)
    return rows


def aes_against_disco(
    docs: Sequence[Mapping], seeds: Mapping[str, int | None], datasets: Sequence[str] | None
) -> tuple[list[dict], list[str]]:
    """AES of every run against the DisCO run of its seed (drpo-eval's ``aes_rows``), then
    per method and knob value the mean and range over seeds; and what could not be scored."""
    notes, per_seed = [], []
    for seed in sorted({s for s in seeds.values() if s is not None}):
        mine = [d for d in docs if seeds[d["name"]] == seed and d["role"] != "base"]
        disco = [d for d in mine if d["role"] == "reference"]
        if not disco:
            notes.append(f"seed {seed}: no finished DisCO run, its runs have no AES")
            continue
        try:
            rows = aes_rows(mine, reference=disco[0], datasets=datasets)
        except ValueError as error:  # e.g. DisCO solved nothing: AES divides by its pass@1
            notes.append(f"seed {seed}: {error}")
            continue
        per_seed += [{**row, "seed": seed} for row in rows]
    groups: dict[tuple, list[dict]] = {}
    for row in per_seed:
        groups.setdefault((row["method"], row["param"]), []).append(row)
    table = []
    for (method, param), rows in groups.items():
        columns = [
            k
            for k in rows[0]
            if k not in ("name", "method", "param_name", "param", "reference", "seed")
        ]
        table.append(
            {
                "method": method,
                "param_name": rows[0]["param_name"],
                "param": param,
                "seeds": [r["seed"] for r in rows],
                **{c: spread(r[c] for r in rows) for c in columns},
            }
        )
    return table, notes


def _cell(value: Mapping[str, float] | None, scale: float = 1.0, digits: int = 1) -> str:
    if not value:
        return "-"
    mean, low, high = (scale * value[k] for k in ("mean", "min", "max"))
    if low == high:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({low:.{digits}f}..{high:.{digits}f})"


def _label(row: Mapping) -> str:
    if row.get("param") is None:
        return str(row["method"])
    label = f"{row['method']} {row.get('param_name') or ''}={row['param']}"
    return f"{label} (DisCO)" if row.get("role") == "reference" else label


def _matched_markdown(
    rows: Sequence[Mapping], notes: Sequence[str], panels: Sequence[str]
) -> list[str]:
    if not rows and not notes:
        return []
    lines = [
        "",
        "## Variants against their method's curve at the same length (same seed)",
        "",
        "Per seed, the variant minus its method's runs (DisCO included) interpolated at the "
        "variant's average length; pass@1 in points, length in tokens.",
        "",
        "| setting | seeds | " + " | ".join(f"{p} pass@1 | {p} length" for p in panels) + " |",
        "|---" * (2 + 2 * len(panels)) + "|",
    ]
    for row in rows:
        cells = []
        for panel in panels:
            found = row["panels"][panel]
            cells += [_signed(found["pass@1"], 100), _signed(found["mean_length"])]
        seeds = ",".join(map(str, row["seeds"]))
        lines.append(f"| {_label(row)} | {seeds} | " + " | ".join(cells) + " |")
    return lines + [f"- {note}" for note in notes]


def _signed(value: Mapping[str, float], scale: float = 1.0) -> str:
    mean, low, high = (scale * value[k] for k in ("mean", "min", "max"))
    return f"{mean:+.1f} ({low:+.1f}..{high:+.1f})"


def markdown(report: Mapping[str, Any]) -> str:
    panels = report["panels"]
    lines = [
        f"# Sweep {report['sweep']}",
        "",
        f"{report['finished']} of {report['total']} runs finished. Mean over seeds, "
        "(min..max) when they differ; pass@1 in %, length in tokens.",
        "",
        "![frontier](frontier.png)",
        "",
        "## Frontier",
        "",
        "| setting | seeds | " + " | ".join(f"{p} pass@1 | {p} length" for p in panels) + " |",
        "|---" * (2 + 2 * len(panels)) + "|",
    ]
    for row in report["frontier"]:
        cells = []
        for panel in panels:
            metrics = row["panels"].get(panel, {})
            cells += [_cell(metrics.get("pass@1"), 100), _cell(metrics.get("mean_length"))]
        seeds = ",".join("-" if s is None else str(s) for s in row["seeds"])
        lines.append(f"| {_label(row)} | {seeds} | " + " | ".join(cells) + " |")
    lines += ["", "## AES against DisCO (same seed)", ""]
    if not report["aes"]:
        lines.append("No run to score yet.")
    else:
        columns = [
            c for c in report["aes"][0] if c not in ("method", "param_name", "param", "seeds")
        ]
        lines += [
            "| setting | seeds | " + " | ".join(columns) + " |",
            "|---" * (2 + len(columns)) + "|",
        ]
        for row in report["aes"]:
            cells = [
                _cell(
                    row[c], 100 if c == "pass@1" else 1, 1 if c in ("pass@1", "mean_length") else 3
                )
                for c in columns
            ]
            lines.append(
                f"| {_label(row)} | {','.join(map(str, row['seeds']))} | "
                + " | ".join(cells)
                + " |"
            )
    lines += [f"- {note}" for note in report["notes"]]
    lines += _matched_markdown(report["matched"], report["matched_notes"], panels)
    entries = [run["training_cost"] for run in report["runs"] if run["training_cost"]]
    lines += ["", *cost_markdown(report["cost"], entries, _label)]
    if any(row["tokens"] for row in report["cost"]):
        lines += ["![accuracy against training tokens](cost.png)", ""]
    lines += [
        "## Runs",
        "",
        "Pushed down: mean over the run's steps of the share of correct responses given a "
        "negative learning signal (`frac_correct_negative_signal`).",
        "",
        "| run | seed | pass@1 | length | pushed down |",
        "|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        pushed = "-" if run["pushed_down"] is None else f"{100 * run['pushed_down']:.1f}%"
        seed = "-" if run["seed"] is None else run["seed"]
        lines.append(
            f"| {run['name']} | {seed} | {100 * run['pass@1']:.1f} | "
            f"{run['mean_length']:.1f} | {pushed} |"
        )
    if report["unfinished"]:
        lines += ["", "Not finished: " + ", ".join(report["unfinished"])]
    return "\n".join(lines) + "\n"


def build_report(sweep: Sweep) -> dict[str, Any]:
    """The report's content from every run that has its done marker."""
    finished: list[tuple[Run, dict]] = []
    for run in sweep.runs:
        marker = state.done(sweep.run_dir(run))
        if marker:
            finished.append((run, marker))
    docs = load_results(marker["result"] for _, marker in finished)
    seeds = {run.name: run.seed for run, _ in finished}
    panels = [AVERAGE, *(sweep.eval_datasets or [])]
    if sweep.eval_datasets is None:
        panels += [d for doc in docs for d in doc["datasets"] if d not in panels]
        panels = list(dict.fromkeys(panels))
    aes, notes = aes_against_disco(docs, seeds, sweep.eval_datasets)
    finished_runs = [run for run, _ in finished]
    matched, matched_notes = matched_length_rows(finished_runs, docs, panels, sweep.eval_datasets)
    trained = [run for run, _ in finished if run.trains]
    costs = {
        r.name: run_cost(sweep.run_dir(r) / "tensorboard", sweep.eval_datasets) for r in trained
    }
    targets = disco_targets(trained, costs)
    entries = {r.name: cost_entry(r, costs[r.name], targets.get(r.seed)) for r in trained}
    runs, cost_points = [], []
    for (run, marker), doc in zip(finished, docs, strict=True):
        average = select_metrics(doc, AVERAGE, sweep.eval_datasets) or doc["average"]
        if run.trains:
            method, param, role = _point(doc)
            cost_points.append(
                {
                    "method": method,
                    "param": param,
                    "role": role,
                    "label": point_label(doc),
                    "pass@1": average["pass@1"],
                    "cost": costs[run.name],
                }
            )
        runs.append(
            {
                "name": run.name,
                "method": run.method,
                "param": run.param,
                "seed": run.seed,
                "pass@1": average["pass@1"],
                "mean_length": average["mean_length"],
                "pushed_down": marker["pushed_down"],
                "result": marker["result"],
                "training_cost": entries.get(run.name),
            }
        )
    return {
        "sweep": sweep.name,
        "total": len(sweep.runs),
        "finished": len(finished),
        "unfinished": [r.name for r in sweep.runs if r.name not in seeds],
        "panels": panels,
        "frontier": frontier_rows(docs, seeds, panels, sweep.eval_datasets),
        "aes": aes,
        "notes": notes,
        "matched": matched,
        "matched_notes": matched_notes,
        "cost": cost_rows(trained, entries),
        "runs": runs,
        "_docs": docs,
        "_cost_points": cost_points,
    }


def write_report(sweep: Sweep) -> Path:
    """``report.md``, ``report.json``, ``frontier.png`` and (once a run logged its tokens)
    ``cost.png`` in the sweep's output dir."""
    report = build_report(sweep)
    docs = report.pop("_docs")
    cost_points = report.pop("_cost_points")
    if not docs:
        raise RuntimeError(f"sweep {sweep.name}: no finished run to report yet")
    out = sweep.output_dir
    plot_tradeoff(docs, out / "frontier.png", datasets=sweep.eval_datasets)
    if any(row["tokens"] for row in report["cost"]):
        plot_cost(cost_points, out / "cost.png")
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    path = out / "report.md"
    path.write_text(markdown(report), encoding="utf-8")
    return path
