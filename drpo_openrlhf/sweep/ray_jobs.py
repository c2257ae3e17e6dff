"""The ``ray`` backend: ``ray job submit`` per run to an existing cluster. Each job runs
``python -m drpo_openrlhf.sweep task``: the training command, then the evaluation and the done
marker, in Ray's copy of the checkout; outputs must be on storage the job's node sees."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from drpo_openrlhf.runtime.recipe import EXCLUDES
from drpo_openrlhf.sweep.spec import Run, Sweep

REPO = Path(__file__).resolve().parents[2]
ACTIVE = {"PENDING", "RUNNING"}


def submit_command(sweep: Sweep, run: Run, sweep_file: Path, submission_id: str) -> list[str]:
    runtime_env = {"working_dir": str(REPO), "excludes": EXCLUDES}
    return [
        *("ray", "job", "submit", "--address", sweep.ray["address"]),
        *("--submission-id", submission_id, "--no-wait"),
        *("--runtime-env-json", json.dumps(runtime_env)),
        *sweep.ray.get("submit_args", []),
        "--",
        *("python", "-m", "drpo_openrlhf.sweep", "task", str(sweep_file), "--run", run.name),
    ]


def submit(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ray job submit failed: {result.stderr.strip()[-2000:]}")


def job_state(address: str, submission_id: str) -> str | None:
    """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED; None when Ray does not answer."""
    result = subprocess.run(
        ["ray", "job", "status", "--address", address, submission_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = re.search(r"\b(PENDING|RUNNING|SUCCEEDED|FAILED|STOPPED)\b", result.stdout)
    return found.group(1) if found else None
