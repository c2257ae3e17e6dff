"""``drpo-eval`` / ``python -m drpo_openrlhf.eval``: evaluate models, plot, tabulate AES.

drpo-eval [run] --model DIR [--model DIR ...] --data FILE.jsonl [...] [options]
drpo-eval plot results/*.json -o tradeoff.png
drpo-eval aes results/*.json [-o aes.csv]
drpo-eval cost RUN/tensorboard [...] [--target 0.45] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from drpo_openrlhf.eval.problems import AVERAGE
from drpo_openrlhf.rewards.answer_format import FORMATS, AnswerFormatError, answer_format

COMMANDS = ("run", "plot", "aes", "cost")


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="drpo-eval [run]",
        description="Evaluate models on prepared JSONL datasets (defaults: the paper's protocol). "
        "Other commands: 'drpo-eval plot --help', 'drpo-eval aes --help'.",
    )
    p.add_argument("--model", action="append", required=True, help="HF model dir; repeatable")
    p.add_argument("--data", nargs="+", required=True, help="JSONL: prompt, label, datasource")
    p.add_argument("--output-dir", type=Path, default=Path("results"))
    p.add_argument("--cache-dir", type=Path, help="generation cache (default OUTPUT_DIR/cache)")
    label = p.add_argument_group("labels (one value per --model, in order)")
    label.add_argument("--name", action="append", help="result file stem")
    label.add_argument("--method", help="curve name in plots, e.g. DRPO (all models)")
    label.add_argument("--param-name", help="name of the method's knob, e.g. lambda (all models)")
    label.add_argument("--param", action="append", help="knob value of this model, e.g. 0.1")
    label.add_argument(
        "--role",
        action="append",
        choices=("run", "reference", "base"),
        help="run (default), reference (no length penalty: AES reference) or base; "
        "one value applies to all models",
    )
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--n", type=int, default=16, help="samples per problem")
    sampling.add_argument("--temperature", type=float, default=0.6)
    sampling.add_argument("--top-p", type=float, default=0.95)
    sampling.add_argument("--max-new-tokens", type=int, default=8192)
    sampling.add_argument("--seed", type=int, default=0)
    sampling.add_argument("--k", type=int, nargs="+", help="pass@k values (default: n)")
    backend = p.add_argument_group("generation backend")
    backend.add_argument(
        "--backend",
        choices=("auto", "vllm", "hf"),
        default="auto",
        help="auto: vllm when importable, else hf",
    )
    backend.add_argument("--dtype", default="auto")
    backend.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm")
    backend.add_argument("--data-parallel-size", type=int, default=1, help="vllm")
    backend.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vllm")
    backend.add_argument("--max-model-len", type=int, help="vllm (default: the model's)")
    backend.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vllm: no CUDA graphs or torch.compile (vLLM's CPU build under TORCHDYNAMO_DISABLE)",
    )
    backend.add_argument("--batch-size", type=int, default=8, help="hf: prompts per generate")
    backend.add_argument("--device", help="hf (default: cuda if available, else cpu)")
    grading = p.add_argument_group("grading")
    grading.add_argument("--grader", default=None, help="module:function (default: math reward)")
    grading.add_argument(
        "--answer-format",
        choices=FORMATS,
        default="auto",
        help="whether answers follow </think> ('thinking') or are read whole where a response "
        "has none ('plain'); 'auto' decides per model from its chat template, as the training "
        "entry point does (default %(default)s; docs/rewards.md)",
    )
    grading.add_argument(
        "--no-require-think-end",
        dest="answer_format",
        action="store_const",
        const="plain",
        help="the same as --answer-format plain",
    )
    grading.add_argument("--grade-timeout", type=float, help="seconds per response")
    grading.add_argument("--grade-batch-size", type=int, default=512)
    run = p.add_argument_group("run")
    run.add_argument("--chunk-size", type=int, default=256, help="prompts per cached batch")
    run.add_argument("--limit", type=int, help="first N problems of each dataset")
    run.add_argument("--no-progress", action="store_true")
    return p


def _per_model(values: list[str] | None, count: int, option: str, broadcast: bool = False):
    if values is None:
        return [None] * count
    if broadcast and len(values) == 1:
        return values * count
    if len(values) != count:
        raise SystemExit(f"{option} given {len(values)} times for {count} models")
    return values


def default_name(model: str, method: str | None, param: str | None) -> str:
    """``METHOD-PARAM`` when labelled, else the model directory's name."""
    parts = [method, param] if method else [Path(model.rstrip("/")).name]
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", "-".join(p for p in parts if p))


def _backend_factory(args: argparse.Namespace, backend: str):
    from drpo_openrlhf.eval.generation import HFBackend

    if backend == "hf":
        return lambda path: HFBackend(
            path, dtype=args.dtype, device=args.device, batch_size=args.batch_size
        )
    from drpo_openrlhf.eval.vllm_backend import VLLMBackend

    return lambda path: VLLMBackend(
        path,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        progress=not args.no_progress,
    )


def run_command(argv: Sequence[str]) -> int:
    from drpo_openrlhf.eval.generation import SamplingSettings
    from drpo_openrlhf.eval.problems import load_problems
    from drpo_openrlhf.eval.results import write_result
    from drpo_openrlhf.eval.runner import DEFAULT_GRADER, Evaluator, RunLabel, load_grader

    args = _run_parser().parse_args(argv)
    count = len(args.model)
    names = _per_model(args.name, count, "--name")
    params = _per_model(args.param, count, "--param")
    roles = _per_model(args.role, count, "--role", broadcast=True)
    labels = [
        RunLabel(
            name=name or default_name(model, args.method, param),
            method=args.method,
            param=param,
            param_name=args.param_name,
            role=role or "run",
        )
        for model, name, param, role in zip(args.model, names, params, roles, strict=True)
    ]
    if len({label.name for label in labels}) != count:
        raise SystemExit("result names collide; give --name per model")

    backend = args.backend
    if backend == "auto":
        backend = "vllm" if importlib.util.find_spec("vllm") else "hf"
    formats = {}
    for model in dict.fromkeys(args.model):
        try:
            formats[model] = answer_format(model, args.answer_format, "--answer-format")
        except AnswerFormatError as error:
            raise SystemExit(str(error)) from None
        print(f"{model}: {formats[model].line()}")
    grader_kwargs: dict = {}
    if args.grade_timeout is not None:
        grader_kwargs["timeout_s"] = args.grade_timeout
    grader_spec = args.grader or DEFAULT_GRADER
    sampling = SamplingSettings(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    datasets = load_problems(args.data, limit=args.limit)
    for model, label in zip(args.model, labels, strict=True):
        kwargs = {"require_think_end": formats[model].require_think_end, **grader_kwargs}
        evaluator = Evaluator(
            sampling=sampling,
            grader=load_grader(grader_spec, **kwargs),
            backend_factory=_backend_factory(args, backend),
            cache_dir=args.cache_dir or args.output_dir / "cache",
            backend_key={"backend": backend, "dtype": args.dtype},
            grader_info={"function": grader_spec, **kwargs},
            ks=args.k or [args.n],
            chunk_size=args.chunk_size,
            grade_batch_size=args.grade_batch_size,
            progress=not args.no_progress,
        )
        doc = evaluator.evaluate(model, datasets, label)
        json_path, _ = write_result(doc, args.output_dir)
        avg = doc["average"]
        print(
            f"{label.name}: pass@1 {avg['pass@1']:.4f}, mean length {avg['mean_length']:.1f}, "
            f"reflections {avg['mean_reflections']:.2f}, restated answers "
            f"{avg['mean_restated_answers']:.2f} -> {json_path}"
        )
    return 0


def plot_command(argv: Sequence[str]) -> int:
    from drpo_openrlhf.eval.plot import plot_tradeoff
    from drpo_openrlhf.eval.results import load_results

    p = argparse.ArgumentParser(prog="drpo-eval plot", description="Trade-off figure (PNG).")
    p.add_argument("results", nargs="+", type=Path, help="result JSON files")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--datasets", nargs="+", help=f"panels, and what {AVERAGE!r} averages")
    p.add_argument(
        "--metric",
        default="pass@1",
        help="y axis against mean length: pass@k, or a per-response count such as "
        "mean_reflections or mean_restated_answers(_correct) (default %(default)s)",
    )
    args = p.parse_args(argv)
    plot_tradeoff(
        load_results(args.results), args.output, datasets=args.datasets, metric=args.metric
    )
    print(args.output)
    return 0


def aes_command(argv: Sequence[str]) -> int:
    from drpo_openrlhf.eval.aes_table import aes_rows, format_table, write_rows
    from drpo_openrlhf.eval.results import load_results

    p = argparse.ArgumentParser(
        prog="drpo-eval aes",
        description="AES of each 'run' result against its method's 'reference' result.",
    )
    p.add_argument("results", nargs="+", type=Path, help="result JSON files")
    p.add_argument("--reference", type=Path, help="one reference for all runs")
    p.add_argument("--datasets", nargs="+", help="datasets (default: those shared)")
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--beta", type=float, default=3.0)
    p.add_argument("--gamma", type=float, default=10.0)
    p.add_argument("-o", "--output", type=Path, help=".csv or .json")
    args = p.parse_args(argv)
    docs = load_results(args.results)
    reference = load_results([args.reference])[0] if args.reference else None
    rows = aes_rows(
        docs,
        reference=reference,
        datasets=args.datasets,
        alpha=args.alpha,
        beta=args.beta,
        gamma=args.gamma,
    )
    print(format_table(rows))
    if args.output:
        write_rows(rows, args.output)
    return 0


def cost_command(argv: Sequence[str]) -> int:
    import json

    from drpo_openrlhf.eval.tensorboard_logs import read_scalars
    from drpo_openrlhf.eval.training_cost import summary, training_cost

    p = argparse.ArgumentParser(
        prog="drpo-eval cost",
        description="What each run cost to train, from its own tensorboard log: response "
        "tokens, wall time per phase, in-training evaluations with the tokens and time spent "
        "until each.",
    )
    p.add_argument("logs", nargs="+", type=Path, help="runs' --logger.tensorboard_dir")
    p.add_argument("--datasets", nargs="+", help="datasources the evaluations average over")
    p.add_argument("--target", type=float, help="pass@1 (0-1): first evaluation reaching it")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = p.parse_args(argv)
    costs = {str(d): training_cost(read_scalars(d), args.datasets) for d in args.logs}
    if args.json:
        print(json.dumps(costs, indent=2))
    else:
        for directory, cost in costs.items():
            print(directory)
            print("\n".join(f"  {line}" for line in summary(cost, args.target)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "run"
    handlers = {"run": run_command, "plot": plot_command, "aes": aes_command, "cost": cost_command}
    handler = handlers[command]
    return handler(argv)
