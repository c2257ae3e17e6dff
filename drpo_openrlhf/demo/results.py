"""The demo's results: each model evaluated with ``drpo-eval``'s evaluator, the summary
table against the reference (DisCO) and the base, and the share of correct responses a run
pushed down (from its tensorboard logs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drpo_openrlhf.demo.config import DemoConfig
from drpo_openrlhf.demo.toy_task import response_shape


def evaluate(
    config: DemoConfig,
    models: list[tuple[Path, Any]],
    eval_file: Path,
    out_dir: Path,
    progress: bool,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, dict[str, float]]]]:
    """Result documents (``drpo-eval``'s schema) of each ``(model dir, RunLabel)``, and per
    model and dataset how its responses got their length: the share that skipped the steps
    and the mean number of re-checks (read back from the generation cache)."""
    from drpo_openrlhf.eval.generation import HFBackend, SamplingSettings
    from drpo_openrlhf.eval.problems import load_problems
    from drpo_openrlhf.eval.results import write_result
    from drpo_openrlhf.eval.runner import DEFAULT_GRADER, Evaluator, load_grader

    rl = config.rl
    evaluator = Evaluator(
        sampling=SamplingSettings(
            n=config.eval_samples,
            temperature=rl.temperature,
            top_p=rl.top_p,
            max_new_tokens=rl.max_new_tokens,
            seed=config.seed,
        ),
        grader=load_grader(),
        backend_factory=lambda path: HFBackend(path, device="cpu", batch_size=64),
        cache_dir=out_dir / "cache",
        backend_key={"backend": "hf", "dtype": "auto"},
        grader_info={"function": DEFAULT_GRADER, "require_think_end": True},
        ks=[config.eval_samples],
        progress=progress,
    )
    datasets = load_problems([eval_file])
    docs, shapes = [], {}
    for path, label in models:
        doc = evaluator.evaluate(str(path), datasets, label)
        write_result(doc, out_dir)
        docs.append(doc)
        shapes[label.name] = {
            name: _shape_stats([s.text for group in samples for s in group])
            for name, samples in evaluator.generate(str(path), datasets).items()
        }
    return docs, shapes


def _shape_stats(texts: list[str]) -> dict[str, float]:
    shapes = [response_shape(t) for t in texts]
    return {
        "skipped": sum(skipped for skipped, _ in shapes) / len(shapes),
        "rechecks": sum(rechecks for _, rechecks in shapes) / len(shapes),
    }


MAIN_COLUMNS = (
    "name",
    "pass@1",
    "length",
    "length_vs_reference",
    "pass@1_vs_reference",
    "aes_vs_reference",
    "length_vs_base",
    "pass@1_vs_base",
    "correct_pushed_down",
)


def summary_rows(
    docs: list[dict[str, Any]], shapes: dict[str, dict[str, dict[str, float]]]
) -> list[dict[str, Any]]:
    """Per model: dataset-averaged pass@1 and length, their changes against the reference
    (DisCO) and the base, AES against the reference (from the averages, as ``drpo-eval aes``
    computes its average column), then pass@1 and length per dataset. Length changes are
    relative, pass@1 changes in absolute points; ``shapes`` (from ``evaluate``) adds each
    dataset's share of responses that skipped the steps and mean re-checks. AES is None
    while the reference solves nothing (it divides by the reference's pass@1)."""
    from drpo_openrlhf.eval.metrics import aes

    ref = next(d for d in docs if d["role"] == "reference")["average"]
    base = next(d for d in docs if d["role"] == "base")["average"]
    rows = []
    for doc in docs:
        avg = doc["average"]
        acc, length = avg["pass@1"], avg["mean_length"]
        row: dict[str, Any] = {
            "name": doc["name"],
            "pass@1": acc,
            "length": length,
            "length_vs_reference": length / ref["mean_length"] - 1,
            "pass@1_vs_reference": acc - ref["pass@1"],
            "aes_vs_reference": (
                aes(acc, length, ref["pass@1"], ref["mean_length"]) if ref["pass@1"] > 0 else None
            ),
            "length_vs_base": length / base["mean_length"] - 1,
            "pass@1_vs_base": acc - base["pass@1"],
        }
        for name, metrics in doc["datasets"].items():
            row[f"{name} pass@1"] = metrics["pass@1"]
            row[f"{name} length"] = metrics["mean_length"]
        for name, stats in shapes[doc["name"]].items():
            row[f"{name} skipped"] = stats["skipped"]
            row[f"{name} rechecks"] = stats["rechecks"]
        rows.append(row)
    return rows


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "name":
        return str(value)
    if column.startswith("aes"):
        return f"{value:.3f}"
    if column.startswith("length_vs"):
        return f"{100 * value:+.1f}%"
    if column.startswith("pass@1_vs"):
        return f"{100 * value:+.1f}pt"
    if column.endswith("rechecks"):
        return f"{value:.2f}"
    percent = column.endswith(("pass@1", "skipped", "pushed_down"))
    return f"{100 * value:.1f}" if percent else f"{value:.1f}"


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Plain-text table: pass@1 in percent, length in tokens, changes signed."""
    cells = [[_cell(c, row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


# The share of correct responses a method's update pushed down, as each logs it
MISLED_TAGS = (
    "train/drpo/frac_correct_negative_signal",
    "train/rollout/frac_correct_negative_signal",
)


def misled_share(tensorboard_dir: Path) -> float | None:
    """Mean over a run's steps of the share of correct responses given a negative learning
    signal (read back from its tensorboard logs); None if it logged none."""
    from drpo_openrlhf.eval.tensorboard_logs import read_scalars

    logged = read_scalars(tensorboard_dir)
    values = [v for tag in MISLED_TAGS for v in logged.get(tag, {}).values()]
    return sum(values) / len(values) if values else None
