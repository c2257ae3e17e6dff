"""What a sweep knows about each run, on disk in the run's directory: the attempt (who runs it,
where) and the done marker, written only once the final model and its evaluation exist."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

DONE = "sweep-done.json"
ATTEMPT = "sweep-attempt.json"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all (rename), so a kill never leaves half a marker."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    partial.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def record_attempt(run_dir: Path, backend: str, **info: Any) -> None:
    """A new attempt replaces the last one; the done marker of an earlier attempt goes."""
    (run_dir / DONE).unlink(missing_ok=True)
    attempt = {"backend": backend, "started": time.time(), "host": socket.gethostname(), **info}
    write_json(run_dir / ATTEMPT, attempt)


def update_attempt(run_dir: Path, **info: Any) -> None:
    write_json(run_dir / ATTEMPT, {**(read_json(run_dir / ATTEMPT) or {}), **info})


def attempt(run_dir: Path) -> dict[str, Any] | None:
    return read_json(run_dir / ATTEMPT)


def done(run_dir: Path) -> dict[str, Any] | None:
    """The marker, or None while the run is not finished."""
    return read_json(run_dir / DONE)


def mark_done(run_dir: Path, marker: dict[str, Any]) -> None:
    write_json(run_dir / DONE, {**marker, "finished": time.time()})
