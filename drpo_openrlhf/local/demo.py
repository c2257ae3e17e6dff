"""``make demo`` / ``python -m drpo_openrlhf.local.demo``: DRPO against a length-penalised
GRPO-style baseline on the toy task, on CPU, in minutes.

1. writes the toy task's training and evaluation sets (JSONL, ``drpo-data``'s format);
2. builds a small Qwen2 and fine-tunes it on verbose traces: the base policy;
3. from the base, at the same settings: DisCO (DRPO with lambda = inf, the no-length-penalty
   reference), DRPO and RLOO-LP;
4. evaluates the four models with ``drpo-eval``'s evaluator, prints pass@1, mean length and
   AES against DisCO, and draws the trade-off figure.

Everything is seeded; outputs go to ``--output-dir`` (default ``outputs/demo``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.local.sft import SFTConfig
from drpo_openrlhf.local.toy_task import ToyProblem, ToyTaskConfig, response_shape
from drpo_openrlhf.local.trainer import TrainConfig


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo runs with; ``quick()`` is the seconds-long version the tests use."""

    task: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    hidden_size: int = 96
    num_layers: int = 2
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(steps=1000, batch_size=32))
    num_train_problems: int = 4000
    eval_problems_per_dataset: int = 128
    eval_samples: int = 8
    rl: TrainConfig = field(
        default_factory=lambda: TrainConfig(rollout_steps=40, temperature=1.0, lr=2e-4)
    )
    lam: float = 0.1
    alpha: float = 0.2
    seed: int = 0

    @staticmethod
    def quick() -> DemoConfig:
        """Seconds instead of minutes: sums of two or three 1s and 2s, a smaller model, a
        short SFT and a few rollouts at a higher learning rate."""
        return DemoConfig(
            task=ToyTaskConfig(min_terms=2, max_terms=3, max_operand=2),
            hidden_size=64,
            sft=SFTConfig(steps=300, batch_size=32, warmup_steps=10),
            num_train_problems=200,
            eval_problems_per_dataset=16,
            eval_samples=4,
            rl=TrainConfig(
                rollout_steps=12,
                rollout_batch_size=8,
                train_batch_size=32,
                micro_batch_size=16,
                max_new_tokens=96,
                temperature=1.0,
                lr=1e-3,
            ),
        )


def with_seed(config: DemoConfig, seed: int) -> DemoConfig:
    """The same demo with every seed (data, SFT, RL and evaluation sampling) set to ``seed``."""
    return replace(
        config, seed=seed, sft=replace(config.sft, seed=seed), rl=replace(config.rl, seed=seed)
    )


@dataclass(frozen=True)
class Run:
    """One RL run and how its result is labelled in tables and plots."""

    name: str
    method: str
    param_name: str
    param: str
    role: str
    train: TrainConfig
    drpo: DRPOConfig | None


def demo_runs(config: DemoConfig) -> list[Run]:
    """DisCO (the no-penalty reference), DRPO and RLOO-LP: same base, same first rollout,
    same batch arithmetic and optimiser."""
    rl = config.rl
    rloo = replace(rl, method="rloo_lp", shaping_params={"alpha": config.alpha})
    lam = str(config.lam)
    return [
        Run("DisCO", "DRPO", "lambda", "inf", "reference", rl, DRPOConfig(lam=float("inf"))),
        Run(f"DRPO-{lam}", "DRPO", "lambda", lam, "run", rl, DRPOConfig(lam=config.lam)),
        Run(f"RLOO-LP-{config.alpha}", "RLOO-LP", "alpha", str(config.alpha), "run", rloo, None),
    ]


def make_problems(config: DemoConfig) -> tuple[list[ToyProblem], list[ToyProblem]]:
    """Training problems, and an evaluation set with as many problems per number of terms."""
    from drpo_openrlhf.local.toy_task import sample_problem

    rng = random.Random(config.seed)
    train = [sample_problem(rng, config.task) for _ in range(config.num_train_problems)]
    evaluation: list[ToyProblem] = []
    for terms in range(config.task.min_terms, config.task.max_terms + 1):
        level = replace(config.task, min_terms=terms, max_terms=terms)
        evaluation += [sample_problem(rng, level) for _ in range(config.eval_problems_per_dataset)]
    return train, evaluation


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
    return f"{100 * value:.1f}" if column.endswith(("pass@1", "skipped")) else f"{value:.1f}"


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Plain-text table: pass@1 in percent, length in tokens, changes signed."""
    cells = [[_cell(c, row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def run_demo(config: DemoConfig, output_dir: str | Path, *, progress: bool = True) -> dict:
    """The whole demo; returns (and writes to ``summary.json``) the table and timings."""
    from drpo_openrlhf.eval.plot import plot_tradeoff
    from drpo_openrlhf.eval.problems import load_problems
    from drpo_openrlhf.eval.runner import RunLabel
    from drpo_openrlhf.local.sft import train_sft
    from drpo_openrlhf.local.toy_model import build_toy_model
    from drpo_openrlhf.local.toy_task import sample_traces, write_jsonl
    from drpo_openrlhf.local.trainer import train

    out = Path(output_dir)
    shutil.rmtree(out, ignore_errors=True)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    train_problems, eval_problems = make_problems(config)
    train_file = write_jsonl(train_problems, out / "data" / "train.jsonl")
    eval_file = write_jsonl(eval_problems, out / "data" / "eval.jsonl")

    init = build_toy_model(
        out / "models" / "init",
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        seed=config.seed,
    )
    traces = sample_traces(random.Random(config.seed + 1), config.task, train_problems)
    base = train_sft(init, out / "models" / "base", traces, config.sft, progress=progress)
    seconds["sft"] = time.perf_counter() - clock

    prompts = [p for ps in load_problems([train_file]).values() for p in ps]
    models: list[tuple[Path, Any]] = [(base, RunLabel(name="base", role="base"))]
    for run in demo_runs(config):
        clock = time.perf_counter()
        path = train(
            base, prompts, out / "models" / run.name, run.train, run.drpo, progress=progress
        )
        seconds[f"train {run.name}"] = time.perf_counter() - clock
        label = RunLabel(run.name, run.method, run.param, run.param_name, run.role)
        models.append((path, label))

    clock = time.perf_counter()
    docs, shapes = evaluate(config, models, eval_file, out / "results", progress)
    seconds["evaluate"] = time.perf_counter() - clock
    plot_tradeoff(docs, out / "tradeoff.png")
    rows = summary_rows(docs, shapes)
    summary = {"config": asdict(config), "rows": rows, "seconds": seconds}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m drpo_openrlhf.local.demo", description=__doc__)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/demo"))
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke version")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seeds data, SFT, RL, sampling")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    config = with_seed(DemoConfig.quick() if args.quick else DemoConfig(), args.seed)
    start = time.perf_counter()
    summary = run_demo(config, args.output_dir, progress=not args.no_progress)
    rows = summary["rows"]
    print("\n" + format_table(rows, list(MAIN_COLUMNS)))
    for kinds in (("pass@1", "length"), ("skipped", "rechecks")):
        columns = [c for c in rows[0] if c not in MAIN_COLUMNS and c.endswith(kinds)]
        print("\n" + format_table(rows, ["name", *columns]))
    print(
        "\nreference = DisCO (DRPO with lambda = inf, no length reward); "
        f"figure: {args.output_dir / 'tradeoff.png'}; total {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
