"""A stop a run honours between rollout steps, with a checkpoint of the step it stops at.

A file ``DRPO_STOP_REQUESTED`` in the run's ``--ckpt.path`` asks for it: the Slurm launcher
writes it on the time-limit warning, and anyone can ``touch`` it to end a run without losing
the steps since the last regular save. The trainer looks for it once per rollout step, after
the step's update; it then saves that step through OpenRLHF's own save path (so every rank
writes it and the completion marker follows, ``checkpoints.py``) and raises
``StopRequested``, which the entry point turns into a clean exit. The entry point removes a
request left from an earlier run at start, or a requeued run would stop after one step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STOP_FILE = "DRPO_STOP_REQUESTED"


class StopRequested(Exception):
    """The run saved the step at which a stop was requested; not a failure."""


def stop_request_file(ckpt_path: str) -> Path:
    return Path(ckpt_path) / STOP_FILE


def stop_requested(ckpt_path: str) -> bool:
    return stop_request_file(ckpt_path).exists()


def clear_stale_request(ckpt_path: str) -> str | None:
    """Remove a request an earlier run left (it was honoured, or came too late); returns
    what was done, for the log, or None when there was none."""
    path = stop_request_file(ckpt_path)
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return f"removed the stop request {path} left by an earlier run"


@contextmanager
def saving_this_step(ckpt_args: Any) -> Iterator[None]:
    """Make OpenRLHF's ``save_logs_and_checkpoints`` save the step it is called for.

    It saves only when ``global_step % ckpt.save_steps == 0``; a period of 1 for this one
    call runs its own save code (client states, every actor rank, our completion marker),
    and a step that is a save step anyway is still saved once."""
    period = ckpt_args.save_steps
    ckpt_args.save_steps = 1
    try:
        yield
    finally:
        ckpt_args.save_steps = period
