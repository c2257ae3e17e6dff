"""The ``local`` backend: the runs one after another on this machine (a workstation, or the
CPU toy), in one Ray cluster started for the sweep unless ``RAY_ADDRESS`` names one."""

from __future__ import annotations

import os
import shlex
import sys
from contextlib import nullcontext

from drpo_openrlhf.process_tree import interrupt_on_signals, restore_signals
from drpo_openrlhf.sweep import state
from drpo_openrlhf.sweep.commands import eval_argv, train_argv
from drpo_openrlhf.sweep.spec import Run, Sweep
from drpo_openrlhf.sweep.task import run_task


def commands(sweep: Sweep, run: Run) -> list[list[str]]:
    """What the run executes, in order (printed by ``--dry-run``)."""
    python = sys.executable
    train = [[python, "-m", "drpo_openrlhf.train", *train_argv(sweep, run)]] if run.trains else []
    return [*train, [python, "-m", "drpo_openrlhf.eval", *eval_argv(sweep, run)]]


def dry_run(sweep: Sweep, runs: list[Run]) -> None:
    for run in runs:
        print(f"# {run.name}")
        for command in commands(sweep, run):
            print(shlex.join(command))


def run_all(sweep: Sweep, runs: list[Run]) -> list[str]:
    """Runs each of ``runs``; a failed run is reported and the next one starts. Returns the
    names of the runs that failed. Ctrl-C and SIGTERM unwind (``Interrupted``): the run in
    progress is stopped, then the cluster with every process it started."""
    from drpo_openrlhf.demo.training import local_ray_cluster

    failed = []
    previous = interrupt_on_signals()
    own_cluster = any(r.trains for r in runs) and not os.environ.get("RAY_ADDRESS")
    cluster = local_ray_cluster(sweep.local.get("num_gpus", 2)) if own_cluster else nullcontext()
    try:
        with cluster as address:
            if address:
                os.environ["RAY_ADDRESS"] = address
            try:
                for index, run in enumerate(runs, 1):
                    print(f"[{index}/{len(runs)}] {run.name}", flush=True)
                    state.record_attempt(sweep.run_dir(run), "local", pid=os.getpid())
                    try:
                        run_task(sweep, run)
                    except RuntimeError as error:
                        state.update_attempt(sweep.run_dir(run), error=str(error)[:2000])
                        print(f"{run.name} FAILED: {error}", file=sys.stderr, flush=True)
                        failed.append(run.name)
            finally:
                if address:
                    os.environ.pop("RAY_ADDRESS", None)
    finally:
        restore_signals(previous)
    return failed
