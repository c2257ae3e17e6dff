"""Synchronous against asynchronous training (``--train.async_enable``), side by side in one
run at the same settings: the wall time per step of ``python -m drpo_openrlhf.train`` on the
demo's toy (``drpo_openrlhf/demo``: its base and prompts, one actor rank, one vLLM engine)
and, with ``--real``, on SmolLM2-135M-Instruct (``make real-model``) with the demo's prompts.

A step's wall time is taken between consecutive ``Global step`` lines of the driver's output
from the second step on (the first holds the engines' and actors' start-up); the phases are
OpenRLHF's ``timing/*`` of those steps. Synchronous steps run their phases one after another;
``predicted async`` is the step an asynchronous run would take where generation and training
do not share hardware: the longer of generation and the rest (docs/performance.md).

    python scripts/bench_async.py [--steps 6] [--out outputs/bench_async] [--real]
        [--queue-size 1] [--partial]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from drpo_openrlhf.demo.config import DemoConfig
from drpo_openrlhf.demo.training import RUN_ENV, Run, local_ray_cluster, train_command
from drpo_openrlhf.process_tree import run_child

STEP_LINE = re.compile(r"Global step (\d+): ")
PHASES = ("generation", "make_experience", "ppo_train", "broadcast")
# SmolLM2 on the demo's prompts, at the real-model test's sizes (tests/test_e2e_real_model.py);
# later flags win over the demo's
REAL_MODEL_FLAGS = (
    *("--drpo.answer_format", "plain", "--vllm.gpu_memory_utilization", "0.25"),
    *("--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "4"),
    *("--rollout.max_new_tokens", "64", "--data.max_len", "256"),
    *("--train.batch_size", "32", "--train.micro_batch_size", "8"),
)


def run(command: list[str], log: Path, address: str) -> tuple[list[float], list[dict]]:
    """Run ``command``; the arrival time and OpenRLHF's status of each step's line."""
    times, statuses = [], []

    def on_line(line: str) -> None:
        found = STEP_LINE.search(line)
        if found:
            times.append(time.monotonic())
            statuses.append(dict(re.findall(r"'([\w/]+)': ([-+\d.e]+)[,}]", line)))

    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in RUN_ENV.items()}}
    env["RAY_ADDRESS"] = address
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        code = run_child(command, sink, on_line, 60.0, env=env)
    if code:
        sys.exit(f"{command[3:]} failed ({code}): see {log}")
    return times, statuses


def summary(times: list[float], statuses: list[dict]) -> dict[str, float]:
    """Median wall time per step from step 2 on, and the median of each phase there."""
    if len(times) < 3:
        sys.exit("need at least 3 steps")
    out = {"step_s": statistics.median(b - a for a, b in itertools.pairwise(times))}
    for phase in PHASES:
        values = [float(s[f"timing/{phase}"]) for s in statuses[1:] if f"timing/{phase}" in s]
        out[phase] = statistics.median(values) if values else float("nan")
    out["lag"] = max(float(s.get("drpo/policy_lag_max", 0)) for s in statuses)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_async"))
    parser.add_argument("--real", action="store_true", help="also SmolLM2-135M-Instruct")
    parser.add_argument("--queue-size", type=int, default=1)
    parser.add_argument("--partial", action="store_true", help="async with partial rollout")
    args = parser.parse_args()

    from drpo_openrlhf.sweep.toy import build_seed

    config = DemoConfig()
    rl = replace(config.rl, rollout_steps=args.steps)
    root = args.out / "toy"
    build_seed(config, root)
    # the steps' times are what is measured: a rollout without a learning signal goes on
    models = {"toy": (root / "base", ("--drpo.max_steps_without_signal", "0"))}
    if args.real:
        from drpo_openrlhf.models.smollm2 import build

        models["smollm2-135m"] = (build(), (*models["toy"][1], *REAL_MODEL_FLAGS))
    async_flags = ("--train.async_enable", "--train.async_queue_size", str(args.queue_size))
    if args.partial:
        async_flags += ("--train.partial_rollout_enable",)
    modes = {"sync": (), "async": async_flags}
    results: dict[tuple[str, str], dict[str, float]] = {}
    with local_ray_cluster(num_gpus=3) as address:
        for model, (base, model_flags) in models.items():
            for mode, flags in modes.items():
                name = f"{model}-{mode}"
                run_flags = ("--drpo.lam", "0.1", *model_flags, *flags)
                drpo = Run(name, "DRPO", "lambda", "0.1", "run", run_flags)
                command = train_command(rl, drpo, base, root / "train.jsonl", args.out)
                started = time.monotonic()
                times, statuses = run(command, args.out / "logs" / f"{name}.log", address)
                results[model, mode] = summary(times, statuses)
                total = time.monotonic() - started
                print(f"{name}: {total:.0f} s for {len(times)} steps", flush=True)

    head = f"{'model':14} {'mode':6} {'step s':>7} " + " ".join(f"{p:>15}" for p in PHASES)
    print(f"\n{head} {'max lag':>7}")
    for (model, mode), r in results.items():
        phases = " ".join(f"{r[p]:15.1f}" for p in PHASES)
        print(f"{model:14} {mode:6} {r['step_s']:7.1f} {phases} {r['lag']:7.0f}")
    for model in models:
        sync, measured = results[model, "sync"], results[model, "async"]
        rest = sync["make_experience"] + sync["ppo_train"] + sync["broadcast"]
        predicted = max(sync["generation"], rest)
        print(
            f"{model}: async/sync wall per step {measured['step_s'] / sync['step_s']:.2f} "
            f"measured here; predicted where generation has its own devices "
            f"{predicted / sync['step_s']:.2f} (max(generation {sync['generation']:.1f} s, "
            f"the rest {rest:.1f} s) over the sync step)"
        )


if __name__ == "__main__":
    main()
