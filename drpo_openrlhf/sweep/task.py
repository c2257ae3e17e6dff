"""One run, start to finish, on the machine it runs on: training through the entry point
(local backend, Ray jobs), then ``finish``: ``drpo-eval`` on the final model, the pushed-down
share from the run's logs, and the done marker. Slurm tasks train through the recipe and call
``finish`` only."""

from __future__ import annotations

import sys
from pathlib import Path

from drpo_openrlhf.process_tree import run_child
from drpo_openrlhf.sweep import state
from drpo_openrlhf.sweep.commands import eval_argv, model_dir, result_path, train_argv
from drpo_openrlhf.sweep.spec import Run, Sweep

# how long an interrupted run gets to stop on its own before it is killed
CHILD_STOP_S = 60.0


def run_logged(command: list[str], log: Path, label: str) -> None:
    """``command`` with its output appended to ``log``; the training steps are echoed. A
    failure raises with the log's last lines. Our own interruption (Ctrl-C, SIGTERM) stops
    the child first, with the same signal."""
    from drpo_openrlhf.demo.training import STEP_LINE

    def echo_step(line: str) -> None:
        found = STEP_LINE.search(line)
        if found:
            print(f"  {label}: step {found.group(1)}", flush=True)

    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as sink:
        sink.write(f"$ {' '.join(command)}\n")
        sink.flush()
        code = run_child(command, sink, echo_step, CHILD_STOP_S)
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{label} exited with {code}; log: {log}\n{tail}")


def train(sweep: Sweep, run: Run, python: str = sys.executable) -> None:
    """Trains through the entry point, which resumes from the newest complete checkpoint."""
    out = sweep.run_dir(run)
    command = [python, "-m", "drpo_openrlhf.train", *train_argv(sweep, run)]
    run_logged(command, out / "train.log", f"{run.name} train")


def finish(sweep: Sweep, run: Run, python: str = sys.executable) -> dict:
    """Evaluates the run's final model and writes the done marker; returns the marker.
    Raises when the final model is missing (the training did not end) or drpo-eval fails."""
    from drpo_openrlhf.demo.results import misled_share

    out = sweep.run_dir(run)
    model = model_dir(sweep, run)
    if run.trains and not (Path(model) / "config.json").is_file():
        raise RuntimeError(f"{run.name}: no final model in {model}: the training did not finish")
    command = [python, "-m", "drpo_openrlhf.eval", *eval_argv(sweep, run)]
    run_logged(command, out / "eval.log", f"{run.name} eval")
    result = result_path(sweep, run)
    if not result.is_file():
        raise RuntimeError(f"{run.name}: drpo-eval wrote no {result}")
    marker = {
        "run": run.name,
        "result": str(result),
        "model": model,
        "pushed_down": misled_share(out / "tensorboard") if run.trains else None,
    }
    state.mark_done(out, marker)
    return marker


def run_task(sweep: Sweep, run: Run, python: str = sys.executable) -> dict:
    """Train (unless it is the base's evaluation), then finish."""
    if run.trains:
        state.update_attempt(sweep.run_dir(run), stage="train")
        train(sweep, run, python)
    state.update_attempt(sweep.run_dir(run), stage="evaluate")
    return finish(sweep, run, python)
