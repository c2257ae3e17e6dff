"""The commands of one run: its ``python -m drpo_openrlhf.train`` flags (local and Ray), the
recipe's variables (Slurm) and its ``drpo-eval`` call. The sweep owns each run's directory:
``<output_dir>/<run>/{ckpt,model,tensorboard,eval}``, the recipes' layout."""

from __future__ import annotations

import functools
from pathlib import Path

from drpo_openrlhf.rewards.answer_format import AnswerFormat, answer_format
from drpo_openrlhf.runtime import recipe
from drpo_openrlhf.sweep.spec import Run, Sweep, format_value, seeded_flags


def method_env(run: Run) -> dict[str, str]:
    """The run's method as the recipes' variables (METHOD, LAMBDA, SHAPING_PARAMS)."""
    env = {"METHOD": run.method}
    if run.method == "drpo":
        env["LAMBDA"] = format_value(dict(run.params)["lambda"])
    elif run.method != "disco" and run.params:
        env["SHAPING_PARAMS"] = ",".join(f"{k}={format_value(v)}" for k, v in run.params)
    return env


def method_flags(run: Run) -> list[str]:
    """What selects the run's method and its parameters on the entry point: the recipes'
    own translation of those variables."""
    return recipe.method_flags(method_env(run))


def model_dir(sweep: Sweep, run: Run) -> str:
    """The model a run's evaluation reads: its final export, or the base itself."""
    return str(sweep.run_dir(run) / "model") if run.trains else run.base_model


def train_argv(sweep: Sweep, run: Run) -> list[str]:
    """The entry point's arguments: base and data, the sweep's shared flags, the method, the
    method's own flags, then the run's directories (last, so they win; ``--ckpt.load_enable``
    resumes a killed run from its latest checkpoint, and starts fresh without one)."""
    out = sweep.run_dir(run)
    return [
        *("--actor.model_name_or_path", run.base_model),
        *("--data.prompt_dataset", run.train_data),
        *seeded_flags(sweep.train_flags, run.seed),
        *("--train.seed", str(run.seed)),
        *method_flags(run),
        *seeded_flags(run.flags, run.seed),
        *("--ckpt.path", str(out / "ckpt"), "--ckpt.load_enable"),
        *("--ckpt.output_dir", str(out / "model")),
        *("--logger.tensorboard_dir", str(out / "tensorboard")),
    ]


def recipe_env(sweep: Sweep, run: Run) -> dict[str, str]:
    """The launcher's variables for one run (docs/launch.md): its method, seed, base, data and
    directory (``$OUTPUT_ROOT/$RUN_NAME``, which requeue and resume key on)."""
    env = {"RUN_NAME": run.name, "MODEL": run.base_model, "TRAIN_DATA": run.train_data}
    env["SEED"] = str(run.seed)
    return env | method_env(run)


FLAG = "--drpo.answer_format"


def run_answer_format(sweep: Sweep, run: Run) -> AnswerFormat:
    """The answer format the run trains with: its ``--drpo.answer_format`` (the method's flags
    over the sweep's; ``auto`` when neither gives one) decided on its base model, as the
    entry point decides it. Raises ``AnswerFormatError`` where the template cannot say."""
    flags, flag = [*sweep.train_flags, *run.flags], "auto"
    for i, item in enumerate(flags):  # the last one given wins, as in argparse
        if item == FLAG and i + 1 < len(flags):
            flag = flags[i + 1]
        elif item.startswith(FLAG + "="):
            flag = item.partition("=")[2]
    if Path(run.base_model).expanduser().is_dir():  # its files, read anew: cheap
        return answer_format(run.base_model, flag)
    return _hub_answer_format(run.base_model, flag)


@functools.lru_cache(maxsize=64)
def _hub_answer_format(model: str, flag: str) -> AnswerFormat:
    """``answer_format`` of a Hub model once per flag: a sweep asks for every run, and each
    answer asks the Hub for the model's files."""
    return answer_format(model, flag)


def eval_argv(sweep: Sweep, run: Run) -> list[str]:
    """``drpo-eval`` on the run's model, labelled for the frontier and the AES table, graded
    in the answer format the run trains with (the base's evaluation too); the sweep's
    ``[eval] flags`` come last so they can change the protocol (and the seed)."""
    argv = ["--model", model_dir(sweep, run), "--data", *run.eval_data]
    argv += ["--answer-format", run_answer_format(sweep, run).name]
    argv += ["--output-dir", str(eval_dir(sweep, run)), "--name", run.name, "--role", run.role]
    if run.display:
        argv += ["--method", run.display]
    if run.param is not None:
        argv += ["--param-name", str(run.param_name), "--param", run.param]
    if run.seed is not None:
        argv += ["--seed", str(run.seed)]
    return [*argv, "--no-progress", *sweep.eval_flags]


def eval_dir(sweep: Sweep, run: Run) -> Path:
    return sweep.run_dir(run) / "eval"


def result_path(sweep: Sweep, run: Run) -> Path:
    """Where drpo-eval writes the run's result document."""
    return eval_dir(sweep, run) / f"{run.name}.json"
