"""``make demo`` / ``python -m drpo_openrlhf.demo``: DRPO against a length-penalised baseline
on a toy task, on CPU, through the product's own entry point.

1. writes the toy task's training and evaluation sets (JSONL, ``drpo-data``'s format);
2. builds a small Qwen2 and fine-tunes it on verbose traces: the base policy (a small SFT
   loop of its own: OpenRLHF's SFT trainer would need a second stack for one step);
3. starts a local Ray cluster and runs ``python -m drpo_openrlhf.train`` three times from the
   base at the same settings: DisCO (lambda = inf, the no-length-penalty reference), DRPO and
   RLOO-LP. Each run is the real pipeline: a vLLM CPU engine, the DeepSpeed actor, the math
   reward plugin, OpenRLHF's checkpoints and tensorboard logs;
4. evaluates the four models with ``drpo-eval``'s evaluator, prints pass@1, mean length, AES
   against DisCO and the share of correct responses each method pushed down, and draws the
   trade-off figure.

Everything is seeded; outputs go to ``--output-dir`` (default ``outputs/demo``), each run's
full log to ``logs/<run>.log`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from drpo_openrlhf.demo.bases import provide_base
from drpo_openrlhf.demo.config import DemoConfig, make_problems, with_seed
from drpo_openrlhf.demo.results import (
    MAIN_COLUMNS,
    evaluate,
    format_table,
    misled_share,
    summary_rows,
)
from drpo_openrlhf.demo.training import demo_runs, local_ray_cluster, run_logged, train_command
from drpo_openrlhf.process_tree import as_interrupted, interrupt_on_signals


def run_demo(
    config: DemoConfig, output_dir: str | Path, *, progress: bool = True, retrain: bool = False
) -> dict:
    """The whole demo; returns (and writes to ``summary.json``) the table and timings. The
    base is the shipped one of the seed when there is one (``demo/bases.py``), else trained
    here, as it is with ``retrain``."""
    from drpo_openrlhf.demo.toy_task import write_jsonl
    from drpo_openrlhf.eval.plot import plot_tradeoff
    from drpo_openrlhf.eval.runner import RunLabel

    out = Path(output_dir).resolve()
    shutil.rmtree(out, ignore_errors=True)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    train_problems, eval_problems = make_problems(config)
    train_file = write_jsonl(train_problems, out / "data" / "train.jsonl")
    eval_file = write_jsonl(eval_problems, out / "data" / "eval.jsonl")

    base = out / "models" / "base"
    base_source = provide_base(config, base, retrain=retrain, progress=progress)
    if progress:
        print(f"base policy: {base_source} ({base})", flush=True)
    seconds["sft"] = time.perf_counter() - clock

    models: list[tuple[Path, Any]] = [(base, RunLabel(name="base", role="base"))]
    misled: dict[str, float | None] = {"base": None}
    with local_ray_cluster(num_gpus=2) as address:
        os.environ["RAY_ADDRESS"] = address
        try:
            for run in demo_runs(config):
                clock = time.perf_counter()
                if progress:
                    print(f"{run.name}: python -m drpo_openrlhf.train ...", flush=True)
                command = train_command(config.rl, run, base, train_file, out)
                log = out / "logs" / f"{run.name}.log"
                run_logged(command, log, run.name, config.rl.rollout_steps, progress)
                seconds[f"train {run.name}"] = time.perf_counter() - clock
                label = RunLabel(run.name, run.method, run.param, run.param_name, run.role)
                models.append((out / "models" / run.name, label))
                misled[run.name] = misled_share(out / "tensorboard" / run.name)
        finally:
            os.environ.pop("RAY_ADDRESS", None)

    clock = time.perf_counter()
    docs, shapes = evaluate(config, models, eval_file, out / "results", progress)
    seconds["evaluate"] = time.perf_counter() - clock
    plot_tradeoff(docs, out / "tradeoff.png")
    rows = summary_rows(docs, shapes)
    for row in rows:
        row["correct_pushed_down"] = misled[row["name"]]
    summary = {"config": asdict(config), "base": base_source, "rows": rows, "seconds": seconds}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m drpo_openrlhf.demo", description=__doc__)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/demo"))
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke version")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seeds data, SFT, RL, sampling")
    parser.add_argument(
        "--train-base",
        action="store_true",
        help="train the base policy here (SFT) even where a shipped one fits (seeds 0-2)",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    config = with_seed(DemoConfig.quick() if args.quick else DemoConfig(), args.seed)
    start = time.perf_counter()
    interrupt_on_signals()
    try:
        summary = run_demo(
            config, args.output_dir, progress=not args.no_progress, retrain=args.train_base
        )
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (interrupt_on_signals)
        raise SystemExit(interrupted_line(stop, args.output_dir)) from None
    rows = summary["rows"]
    print("\n" + format_table(rows, list(MAIN_COLUMNS)))
    for kinds in (("pass@1", "length"), ("skipped", "rechecks")):
        columns = [c for c in rows[0] if c not in MAIN_COLUMNS and c.endswith(kinds)]
        print("\n" + format_table(rows, ["name", *columns]))
    print(
        "\nreference = DisCO (DRPO with lambda = inf, no length reward); "
        f"figure: {args.output_dir / 'tradeoff.png'}; total {time.perf_counter() - start:.0f} s"
    )


def interrupted_line(stop: KeyboardInterrupt, output_dir: Path) -> int:
    """Says how the demo stopped, once every process it started is gone; its exit status."""
    interrupted = as_interrupted(stop)
    print(
        f"python -m drpo_openrlhf.demo: interrupted by {interrupted.name}; every process it "
        f"started is stopped. Outputs so far (each run's log in logs/) are in {output_dir}; "
        "run it again to start over",
        file=sys.stderr,
        flush=True,
    )
    return interrupted.exit_code


if __name__ == "__main__":
    main()
