"""Each run's state: ``done`` (marker), ``queued``/``running`` (its backend says so),
``failed`` (an attempt that is no longer active and left no marker), ``missing`` (never
submitted). A re-run submits the failed and missing ones."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from drpo_openrlhf.sweep import ray_jobs, slurm, state
from drpo_openrlhf.sweep.spec import Run, Sweep


@dataclass(frozen=True)
class RunState:
    run: Run
    state: str
    detail: str = ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_states(sweep: Sweep) -> list[RunState]:
    attempts = {run.name: state.attempt(sweep.run_dir(run)) for run in sweep.runs}
    arrays = {a["job"].split("_")[0] for a in attempts.values() if a and a["backend"] == "slurm"}
    queue = slurm.queue_states(arrays)
    states = []
    for run in sweep.runs:
        marker, attempt = state.done(sweep.run_dir(run)), attempts[run.name]
        if marker:
            states.append(RunState(run, "done", marker["result"]))
        elif attempt is None:
            states.append(RunState(run, "missing"))
        else:
            states.append(RunState(run, *_attempt_state(attempt, queue)))
    return states


def _attempt_state(attempt: dict, queue: dict[str, str]) -> tuple[str, str]:
    backend = attempt["backend"]
    if backend == "local":
        here = attempt["host"] == socket.gethostname()
        if here and _alive(attempt["pid"]) and "error" not in attempt:
            return "running", f"pid {attempt['pid']}, {attempt.get('stage', 'starting')}"
        return "failed", attempt.get("error", "interrupted").splitlines()[0]
    if backend == "slurm":
        job = attempt["job"]
        found = queue.get(job)
        if found in slurm.ACTIVE:
            return ("queued" if found == "PENDING" else "running"), f"job {job} {found}"
        return "failed", f"job {job} ended without a marker (log: {attempt.get('log', '?')})"
    found = ray_jobs.job_state(attempt["address"], attempt["submission_id"])
    if found in ray_jobs.ACTIVE:
        return (
            "queued" if found == "PENDING" else "running"
        ), f"{attempt['submission_id']} {found}"
    return "failed", f"ray job {attempt['submission_id']}: {found or 'unknown to Ray'}"


def format_states(states: list[RunState]) -> str:
    width = max(len(s.run.name) for s in states)
    lines = [f"{s.run.name.ljust(width)}  {s.state:8}  {s.detail}".rstrip() for s in states]
    counts: dict[str, int] = {}
    for s in states:
        counts[s.state] = counts.get(s.state, 0) + 1
    lines.append(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return "\n".join(lines)
