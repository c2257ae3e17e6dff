"""The report's training cost: per run, what ``eval.training_cost`` reads from the run's own
tensorboard log (tokens generated, wall time per phase, the in-training evaluations), and
the tokens and time until it first reached the accuracy of the DisCO run of its seed; per
setting, the mean and range over seeds. The target is DisCO's last in-training evaluation,
so both sides of the comparison come from the same evaluation (OpenRLHF's, at
``--eval.steps``), not the sweep's final ``drpo-eval`` of another protocol."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from drpo_openrlhf.eval.tensorboard_logs import read_scalars
from drpo_openrlhf.eval.training_cost import PHASES, first_reaching, training_cost
from drpo_openrlhf.sweep.seed_spread import spread
from drpo_openrlhf.sweep.spec import Run


def run_cost(tensorboard_dir: Path, datasets: Sequence[str] | None) -> dict[str, Any] | None:
    """A run's cost, or None when it left no log with step timing."""
    if not tensorboard_dir.is_dir():
        return None
    return training_cost(read_scalars(tensorboard_dir), datasets)


def disco_targets(runs: Sequence[Run], costs: Mapping[str, dict | None]) -> dict[int, float]:
    """Per seed, the last in-training pass@1 of its DisCO run (when it evaluated along)."""
    targets = {}
    for run in runs:
        cost = costs.get(run.name)
        if run.role == "reference" and run.seed is not None and cost and cost["evaluations"]:
            targets[run.seed] = cost["evaluations"][-1]["pass@1"]
    return targets


def cost_entry(run: Run, cost: dict | None, target: float | None) -> dict[str, Any]:
    """One run's row: its cost and, against its seed's target, the first evaluation that
    reached it (``reached``: None when none did or there was nothing to compare)."""
    entry: dict[str, Any] = {"name": run.name, "seed": run.seed, "target": target, "cost": cost}
    reachable = cost is not None and target is not None and bool(cost["evaluations"])
    entry["reached"] = first_reaching(cost, target) if reachable else None
    entry["compared"] = reachable
    return entry


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    return spread(values) if values else None


def _share(cost: Mapping, phase: str) -> float | None:
    seconds = cost["phases_s"][phase]
    return None if seconds is None or not cost["seconds"] else seconds / cost["seconds"]


def cost_rows(runs: Sequence[Run], entries: Mapping[str, dict]) -> list[dict[str, Any]]:
    """Per method and knob value: tokens, seconds and each phase's share of them, mean and
    range over the seeds that logged them; how many seeds were compared with DisCO and
    reached it, with the tokens and seconds until then over those that did."""
    groups: dict[tuple, list[tuple[Run, dict]]] = {}
    for run in runs:
        entry = entries.get(run.name)
        if entry is not None and entry["cost"] is not None:
            key = (run.display or run.method, run.param_name, run.param, run.role)
            groups.setdefault(key, []).append((run, entry))
    rows = []
    for (method, param_name, param, role), members in groups.items():
        costs = [entry["cost"] for _, entry in members]
        reached = [entry["reached"] for _, entry in members if entry["reached"]]
        tokens_to = [p["tokens"] for p in reached if p["tokens"] is not None]
        rows.append(
            {
                "method": method,
                "param_name": param_name,
                "param": param,
                "role": role,
                "seeds": [run.seed for run, _ in members],
                "tokens": _spread([c["tokens"] for c in costs if c["tokens"] is not None]),
                "seconds": _spread([c["seconds"] for c in costs]),
                "phase_share": {
                    phase: _spread([s for c in costs if (s := _share(c, phase)) is not None])
                    for phase in PHASES
                },
                "compared": sum(entry["compared"] for _, entry in members),
                "reached": len(reached),
                "tokens_to_disco": _spread(tokens_to),
                "seconds_to_disco": _spread([p["seconds"] for p in reached]),
            }
        )
    return rows


def _amount(value: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def _cell(value: Mapping[str, float] | None, show: Callable[[float], str] = _amount) -> str:
    if not value:
        return "-"
    mean, low, high = (value[k] for k in ("mean", "min", "max"))
    return show(mean) if low == high else f"{show(mean)} ({show(low)}..{show(high)})"


def _percent(value: float) -> str:
    return f"{100 * value:.0f}%"


def cost_markdown(
    rows: Sequence[Mapping], entries: Sequence[Mapping], label: Callable[[Mapping], str]
) -> list[str]:
    """The report's "Training cost" section: the per-setting table, then one line per run."""
    lines = [
        "## Training cost",
        "",
        "From each run's own tensorboard log: response tokens generated in training, wall "
        "time of the rollout steps (start-up, saves and in-training evaluations excluded) "
        "and each phase's share of it; grading runs inside generation. To DisCO: tokens and "
        "time until the run's in-training evaluation first reached the last one of the DisCO "
        "run of its seed (reached / compared seeds). Mean over seeds (min..max).",
        "",
        "| setting | seeds | tokens | time (s) | "
        + " | ".join(PHASES.values())
        + " | reached DisCO | tokens to DisCO | time to DisCO (s) |",
        "|---" * (7 + len(PHASES)) + "|",
    ]
    if not rows:
        return [*lines[:2], "No run logged step timing yet.", ""]
    for row in rows:
        shares = [_cell(row["phase_share"][p], _percent) for p in PHASES]
        reached = f"{row['reached']}/{row['compared']}" if row["compared"] else "-"
        cells = [
            ",".join("-" if s is None else str(s) for s in row["seeds"]),
            _cell(row["tokens"]),
            _cell(row["seconds"]),
            *shares,
            reached,
            _cell(row["tokens_to_disco"]),
            _cell(row["seconds_to_disco"]),
        ]
        lines.append(f"| {label(row)} | " + " | ".join(cells) + " |")
    lines += ["", "| run | steps | tokens | time (s) | DisCO's pass@1 | reached at step |"]
    lines.append("|---|---|---|---|---|---|")
    for entry in entries:
        cost = entry["cost"]
        if cost is None:
            lines.append(f"| {entry['name']} | no step timing logged | | | | |")
            continue
        steps = str(cost["steps"])
        if cost["missing_steps"]:
            steps += f" (steps {','.join(map(str, cost['missing_steps']))} not logged)"
        target = "-" if entry["target"] is None else f"{100 * entry['target']:.1f}"
        if not cost["evaluations"]:
            reached = "no in-training evaluations"
        elif entry["target"] is None:
            reached = "no DisCO evaluation of its seed to compare with"
        else:
            reached = str(entry["reached"]["step"]) if entry["reached"] else "not reached"
        tokens = "-" if cost["tokens"] is None else _amount(cost["tokens"])
        lines.append(
            f"| {entry['name']} | {steps} | {tokens} | {cost['seconds']:.1f} | {target} | "
            f"{reached} |"
        )
    return [*lines, ""]
