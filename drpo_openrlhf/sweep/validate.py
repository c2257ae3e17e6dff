"""Loading a sweep file and checking the whole grid before anything is submitted: the file's
structure, methods and their parameter ranges, duplicate runs, the base model, training and
evaluation data, and (for the backends that build the command here) each run's training
command through the entry point's own parser. One ``SweepError`` lists every problem."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

from drpo_openrlhf.runtime import preflight
from drpo_openrlhf.sweep.spec import SEED, Sweep, SweepError, parse_sweep, read_file

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def _absolute(template: str, probe: str) -> str:
    """``template`` made absolute when its expansion ``probe`` is a local path (Ray jobs and
    Slurm tasks run elsewhere than here); a Hugging Face id stays as it is."""
    return os.path.abspath(template) if Path(probe).expanduser().exists() else template


def resolve_paths(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its local paths absolute (first seed's expansion decides)."""
    seed = str((data.get("seeds") or [0])[0])
    out = {**data, **{k: dict(v) for k, v in data.items() if isinstance(v, dict)}}
    train, evaluation = out.get("train", {}), out.get("eval", {})
    for key in ("base_model", "data"):
        if isinstance(train.get(key), str):
            train[key] = _absolute(train[key], train[key].replace(SEED, seed))
    if isinstance(evaluation.get("data"), list):
        evaluation["data"] = [
            _absolute(d, d.replace(SEED, seed)) if isinstance(d, str) else d
            for d in evaluation["data"]
        ]
    slurm = out.get("slurm", {})
    if isinstance(slurm.get("recipe"), str):
        slurm["recipe"] = _absolute(slurm["recipe"], slurm["recipe"])
    if isinstance(out.get("output_dir"), str):
        out["output_dir"] = os.path.abspath(os.path.expanduser(out["output_dir"]))
    return out


def input_problems(sweep: Sweep) -> list[str]:
    """Missing or malformed base models, training and evaluation files, each named once."""
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()

    def once(kind: str, value: str, check) -> None:
        if (kind, value) in seen:
            return
        seen.add((kind, value))
        try:
            check(value)
        except ValueError as error:
            problems.append(f"{kind}: {error}")

    def train_file(name: str) -> None:
        if Path(name).suffix in DATA_SUFFIXES and not Path(name).is_file():
            raise ValueError(f"{name}: no such file")
        preflight.check_prompt_data(name, "prompt", "label")

    def eval_file(name: str) -> None:
        if not Path(name).is_file():
            raise ValueError(f"{name}: no such file (drpo-eval reads local JSONL)")

    for run in sweep.runs:
        once("base model", run.base_model, preflight.check_model)
        if run.trains:
            once("training data", run.train_data, train_file)
        for name in run.eval_data:
            once("evaluation data", name, eval_file)
    return problems


def backend_problems(sweep: Sweep, backend: str) -> list[str]:
    """What the chosen backend needs from the sweep file."""
    problems = []
    if backend == "slurm":
        recipe = sweep.slurm.get("recipe")
        if not isinstance(recipe, str) or not Path(recipe).is_file():
            problems.append(f"[slurm] recipe: no such file {recipe!r} (e.g. slurm/drpo_1.5b.sh)")
        throttle = sweep.slurm.get("throttle")
        if throttle is not None and (not isinstance(throttle, int) or throttle < 1):
            problems.append(f"[slurm] throttle must be an integer >= 1, got {throttle!r}")
        env = sweep.slurm.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            problems.append('[slurm] env must be a table of strings (NAME = "value")')
    if backend == "ray" and not isinstance(sweep.ray.get("address"), str):
        problems.append("[ray] address is required (the dashboard, e.g. http://HEAD:8265)")
    if backend == "local":
        gpus = sweep.local.get("num_gpus", 2)
        if not isinstance(gpus, int) or gpus < 1:
            problems.append(f"[local] num_gpus must be an integer >= 1, got {gpus!r}")
    return problems


def answer_format_problems(sweep: Sweep) -> list[str]:
    """Each base model's answer format under the runs' ``--drpo.answer_format``, decided now
    (``commands.run_answer_format``): a template with a thinking switch is refused before any
    run trains rather than when its evaluation is due."""
    from drpo_openrlhf.rewards.answer_format import AnswerFormatError
    from drpo_openrlhf.sweep.commands import run_answer_format

    problems: dict[str, list[str]] = {}  # message -> runs
    for run in sweep.runs:
        try:
            run_answer_format(sweep, run)
        except AnswerFormatError as error:
            problems.setdefault(str(error), []).append(run.name)
    return [f"answer format of {', '.join(runs)}: {m}" for m, runs in problems.items()]


def command_problems(sweep: Sweep) -> list[str]:
    """Each run's training command through ``drpo_openrlhf.train.parse`` (flags, layout,
    refused PPO-only options), as the run itself would check it; one line per run at fault."""
    from drpo_openrlhf.sweep.commands import train_argv
    from drpo_openrlhf.train import parse

    failing: dict[str, list[str]] = {}  # message -> runs, so a shared flag is named once
    for run in sweep.runs:
        if not run.trains:
            continue
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                parse(train_argv(sweep, run))
        except SystemExit:
            message = (stderr.getvalue().strip().splitlines() or ["invalid command"])[-1]
            failing.setdefault(message.split(" error: ", 1)[-1], []).append(run.name)
    return [f"training command of {', '.join(runs)}: {m}" for m, runs in failing.items()]


def load_sweep(path: str | Path, backend: str, seeds: list[int] | None = None) -> Sweep:
    """The checked sweep of ``path`` for ``backend``; raises ``SweepError`` listing every
    problem. ``seeds`` replaces the file's."""
    path = Path(path)
    try:
        data = read_file(path)
    except (OSError, ValueError) as error:  # tomllib/json decode errors are ValueErrors
        raise SweepError(str(path), [f"cannot read the sweep file: {error}"]) from None
    if seeds is not None:
        data["seeds"] = seeds
    problems: list[str] = []
    sweep = parse_sweep(resolve_paths(data), path, problems)
    if sweep is not None:
        problems += input_problems(sweep) + backend_problems(sweep, backend)
        if not problems:
            problems += answer_format_problems(sweep)
        if not problems and backend in ("local", "ray"):
            problems += command_problems(sweep)
    if problems or sweep is None:
        raise SweepError(str(path), problems)
    return sweep
