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
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from drpo_openrlhf.demo.sft import SFTConfig
from drpo_openrlhf.demo.toy_task import ToyProblem, ToyTaskConfig, response_shape

# what the runs need on a machine without a model hub; setdefault, so a user's value wins
RUN_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass(frozen=True)
class RLConfig:
    """What every RL run shares (``drpo_openrlhf.train``'s flag in each comment)."""

    rollout_steps: int = 32  # --drpo.max_steps
    rollout_batch_size: int = 16  # --rollout.batch_size (prompts)
    n_samples_per_prompt: int = 8  # --rollout.n_samples_per_prompt
    train_batch_size: int = 64  # --train.batch_size (responses per optimizer step)
    micro_batch_size: int = 64  # --train.micro_batch_size
    max_new_tokens: int = 128  # --rollout.max_new_tokens
    temperature: float = 1.0  # --rollout.temperature
    top_p: float = 1.0  # --rollout.top_p
    # --actor.adam.lr; the paper's 1.5B runs use 2e-6. 5e-5, not the earlier 2e-4: at 2e-4
    # every method shortened without a length reward and lost accuracy (docs/demo.md, Ablation)
    lr: float = 5e-5
    seed: int = 0  # --train.seed


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo runs with; ``quick()`` is the short version the tests use."""

    task: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    hidden_size: int = 96
    num_layers: int = 2
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(steps=1000, batch_size=32))
    num_train_problems: int = 4000
    eval_problems_per_dataset: int = 128
    eval_samples: int = 8
    rl: RLConfig = field(default_factory=RLConfig)
    lam: float = 0.1
    alpha: float = 0.2
    seed: int = 0

    @staticmethod
    def quick() -> DemoConfig:
        """Sums of two or three 1s and 2s, a smaller model, a short SFT and a few rollouts
        at a higher learning rate."""
        return DemoConfig(
            task=ToyTaskConfig(min_terms=2, max_terms=3, max_operand=2),
            hidden_size=64,
            sft=SFTConfig(steps=300, batch_size=32, warmup_steps=10),
            num_train_problems=200,
            eval_problems_per_dataset=16,
            eval_samples=4,
            rl=RLConfig(
                rollout_steps=12,
                rollout_batch_size=8,
                train_batch_size=32,
                micro_batch_size=32,
                max_new_tokens=96,
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
    """One RL run: its ``drpo_openrlhf.train`` flags and how its result is labelled."""

    name: str
    method: str
    param_name: str
    param: str
    role: str
    flags: tuple[str, ...]


def demo_runs(config: DemoConfig) -> list[Run]:
    """DisCO (the no-penalty reference), DRPO and RLOO-LP: same base, same settings. RLOO-LP
    runs OpenRLHF's PPO actor without a reference model, like the others."""
    lam, alpha = str(config.lam), str(config.alpha)
    rloo = ("--shaping.method", "rloo_lp", "--shaping.params", f"alpha={alpha}")
    rloo += ("--algo.kl.init_coef", "0")
    return [
        Run("DisCO", "DRPO", "lambda", "inf", "reference", ("--drpo.lam", "inf")),
        Run(f"DRPO-{lam}", "DRPO", "lambda", lam, "run", ("--drpo.lam", lam)),
        Run(
            f"RLOO-LP-{alpha}",
            "RLOO-LP",
            "alpha",
            alpha,
            "run",
            (*rloo, "--algo.kl.init_coef", "0"),
        ),
    ]


def shared_flags(rl: RLConfig) -> list[str]:
    """The ``drpo_openrlhf.train`` flags every toy run shares: one actor rank and one vLLM
    engine (non-colocated), ZeRO-2, the rollout and optimiser settings (``drpo-sweep toy``
    writes them into its sweep file). The toy policy thinks (``<think> ... </think>``) under a
    plain ChatML template, so the flag says so: ``auto`` would read that template as plain."""
    return [
        *("--data.input_key", "prompt", "--data.label_key", "label", "--data.apply_chat_template"),
        *("--drpo.answer_format", "thinking"),
        *("--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1"),
        *("--vllm.num_engines", "1", "--vllm.enforce_eager"),
        *("--vllm.gpu_memory_utilization", "0.1"),  # on CPU: the share of RAM for KV cache
        *("--rollout.batch_size", str(rl.rollout_batch_size)),
        *("--rollout.n_samples_per_prompt", str(rl.n_samples_per_prompt)),
        *("--rollout.max_new_tokens", str(rl.max_new_tokens)),
        *("--rollout.temperature", str(rl.temperature), "--rollout.top_p", str(rl.top_p)),
        *("--data.max_len", str(rl.max_new_tokens + 64)),
        *("--train.batch_size", str(rl.train_batch_size)),
        *("--train.micro_batch_size", str(rl.micro_batch_size)),
        *("--ds.zero_stage", "2", "--ds.attn_implementation", "sdpa"),
        *("--actor.adam.lr", str(rl.lr)),
        *("--drpo.max_steps", str(rl.rollout_steps)),
    ]


def train_command(rl: RLConfig, run: Run, base: Path, train_file: Path, out: Path) -> list[str]:
    """``python -m drpo_openrlhf.train ...`` for ``run`` from ``base``, with checkpoints and
    the final model in ``out/models/<run>``."""
    return [
        sys.executable,
        "-m",
        "drpo_openrlhf.train",
        *("--actor.model_name_or_path", str(base)),
        *("--data.prompt_dataset", str(train_file)),
        *shared_flags(rl),
        *("--train.seed", str(rl.seed)),
        *("--ckpt.path", str(out / "ckpt" / run.name)),
        *("--ckpt.output_dir", str(out / "models" / run.name)),
        *("--logger.tensorboard_dir", str(out / "tensorboard" / run.name)),
        *run.flags,
    ]


STEP_LINE = re.compile(r"Global step (\d+): ")


def _metric(line: str, key: str) -> str:
    found = re.search(rf"'{re.escape(key)}': ([-+\w.]+)", line)
    return found.group(1) if found else "?"


def run_logged(command: list[str], log: Path, label: str, steps: int, progress: bool) -> None:
    """Runs ``command`` with its output in ``log``, printing one line per training step;
    a failure raises with the log's last lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in RUN_ENV.items()}}
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        assert process.stdout is not None
        for line in process.stdout:
            sink.write(line)
            found = STEP_LINE.search(line)
            if progress and found:
                reward = _metric(line, "rollout/reward_mean")
                length = _metric(line, "rollout/response_length_mean")
                print(
                    f"  {label}: step {found.group(1)}/{steps}  reward {float(reward):.3f}  "
                    f"length {float(length):.1f}",
                    flush=True,
                )
        code = process.wait()
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{label} failed (exit {code}); full log: {log}\n{tail}")


@contextmanager
def local_ray_cluster(num_gpus: int) -> Iterator[str]:
    """A local Ray cluster with fake GPUs for the runs to join (``RAY_ADDRESS``), stopped on
    exit: the CPU stand-in for the cluster a user submits to."""
    import ray

    context = ray.init(
        address="local",
        num_cpus=2 * num_gpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield context.address_info["address"]
    finally:
        ray.shutdown()


def make_problems(config: DemoConfig) -> tuple[list[ToyProblem], list[ToyProblem]]:
    """Training problems, and an evaluation set with as many problems per number of terms."""
    from drpo_openrlhf.demo.toy_task import sample_problem

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


def train_base(
    config: DemoConfig,
    init_dir: Path,
    base_dir: Path,
    train_problems: list[ToyProblem],
    *,
    architecture: str = "qwen2",
    progress: bool = False,
) -> Path:
    """The demo's base policy: the toy model at ``config``'s size and seed (``init_dir``),
    fine-tuned on traces of ``train_problems`` into ``base_dir``."""
    from drpo_openrlhf.demo.sft import train_sft
    from drpo_openrlhf.demo.toy_model import build_toy_model
    from drpo_openrlhf.demo.toy_task import sample_traces

    init = build_toy_model(
        init_dir,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        seed=config.seed,
        architecture=architecture,
    )
    traces = sample_traces(random.Random(config.seed + 1), config.task, train_problems)
    return train_sft(init, base_dir, traces, config.sft, progress=progress)


def run_demo(
    config: DemoConfig, output_dir: str | Path, *, progress: bool = True, retrain: bool = False
) -> dict:
    """The whole demo; returns (and writes to ``summary.json``) the table and timings. The
    base is the shipped one of the seed when there is one (``demo/bases.py``), else trained
    here, as it is with ``retrain``."""
    from drpo_openrlhf.demo.bases import provide_base
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
    summary = run_demo(
        config, args.output_dir, progress=not args.no_progress, retrain=args.train_base
    )
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
