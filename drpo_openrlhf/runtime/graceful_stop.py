"""A stop a run honours at its next safe point, with a checkpoint that loses no finished step.

A file ``DRPO_STOP_REQUESTED`` in the run's ``--ckpt.path`` asks for it: the Slurm launcher
writes it on the time-limit warning, and anyone can ``touch`` it to end a run without losing
the steps since the last regular save. A step is: generation (vLLM), scoring
(``make_experience``), the actor's update, the weight sync, the save. The safe points:

- **before the update begins** (before generation, during it, after it): the actor still holds
  the previous step's weights and optimizer state, so saving now *is* the previous step's
  checkpoint. The trainer drops the rollout in progress (``RolloutCanceller`` cancels its vLLM
  requests within ``POLL_S``), saves the previous step if no regular save did, with the
  client state (episode, consumed prompts, data-loader position, shaper state) recorded at
  that step's end, and stops. The resumed run generates the dropped step again.
- **once the update has begun**: the step finishes (update, sync) and is saved.

So a stop waits for at most one update, one sync and one save, never for a generation; the
trainer writes each step's phase durations and the run's longest update + sync and save to
``drpo_step_times.json`` beside the request file, for the launcher (and the user) to size the
time it gives a stop. Every save goes through OpenRLHF's own save path (every rank writes it
and the completion marker follows, ``checkpoints.py``); then ``StopRequested`` ends the run and
the entry point turns it into a clean exit. The entry point removes a request left from an
earlier run at start, or a requeued run would stop at once.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STOP_FILE = "DRPO_STOP_REQUESTED"
STEP_TIMES_FILE = "drpo_step_times.json"
POLL_S = 1.0  # how often a generation in flight looks for the request file


class StopRequested(Exception):
    """The run saved the step at which a stop was requested; not a failure."""


class StopBeforeUpdate(Exception):
    """A stop request seen before the step's update began: the rollout in progress is dropped
    and the previous step is what the run saves."""


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


def stop_message(step: int | None, saved_now: bool) -> str:
    """The run's last line on a stop before an update: which checkpoint holds the run."""
    if step is None:
        return (
            "stop requested before this run finished a step: nothing new to save (a resume "
            "starts where this run started), stopping"
        )
    saved = f"saved global_step{step}" if saved_now else f"global_step{step} is saved"
    return (
        f"stop requested: {saved}, stopping (step {step + 1} was dropped before its update; "
        "a resume generates it again)"
    )


class RolloutCanceller:
    """Cancels the vLLM requests of the generation in flight once a stop is requested.

    The trainer's thread waits inside OpenRLHF's generation loop; a daemon thread polls the
    request file every ``poll_s`` and cancels every tracked request (``cancel``: Ray's
    ``ray.cancel``, which cancels an async engine actor's coroutine; vLLM then aborts the
    request). The generation loop then meets ``TaskCancelledError``, which the trainer turns
    into a stop."""

    def __init__(self, ckpt_path: str, cancel: Callable[[Any], None], poll_s: float = POLL_S):
        self.ckpt_path, self.cancel, self.poll_s = ckpt_path, cancel, poll_s
        self.requested = False
        self._refs: list = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def track(self, refs: list) -> None:
        """Requests just sent to the engines; cancelled at once if a stop is already known."""
        with self._lock:
            self._refs.extend(refs)
            if self.requested:
                self._cancel_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, daemon=True, name="stop")
                self._thread.start()

    def finished(self) -> None:
        """The generation ended: its requests need no cancelling any more."""
        with self._lock:
            self._refs.clear()

    def _cancel_all(self) -> None:
        for ref in self._refs:
            self.cancel(ref)
        self._refs.clear()

    def _watch(self) -> None:
        while not self.requested:
            time.sleep(self.poll_s)
            if stop_requested(self.ckpt_path):
                with self._lock:
                    self.requested = True
                    self._cancel_all()


class StepTimes:
    """Each step's phase durations (OpenRLHF's ``timing/*``) and the run's longest update +
    sync and save, in ``drpo_step_times.json`` (written whole, by rename)."""

    def __init__(self, ckpt_path: str):
        self.path = Path(ckpt_path) / STEP_TIMES_FILE
        self.longest_update_s = 0.0
        self.longest_save_s: float | None = None

    def record(self, step: int, logs: dict, save_s: float | None) -> dict:
        phases = {
            name: round(float(logs[f"timing/{name}"]), 3)
            for name in ("generation", "make_experience", "ppo_train", "broadcast")
            if f"timing/{name}" in logs
        }
        self.longest_update_s = max(
            self.longest_update_s, phases.get("ppo_train", 0.0) + phases.get("broadcast", 0.0)
        )
        if save_s is not None:
            self.longest_save_s = max(self.longest_save_s or 0.0, save_s)
        longest_save = self.longest_save_s
        record = {
            "step": step,
            "phases_s": phases,
            "longest_update_and_sync_s": round(self.longest_update_s, 3),
            "longest_save_s": None if longest_save is None else round(longest_save, 3),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps(record) + "\n")
        partial.replace(self.path)
        return record


# What a stop needs beyond the update, sync and save: the watcher's poll, the driver's exit
# and Ray's job bookkeeping (measured on CPU: tests/test_slurm_recipes.py); and what the
# launcher needs after the grace: `ray job stop` (15 s), the nodes' teardown (30 + 1 s), slack.
STOP_EXIT_S = 30
AFTER_GRACE_S = 60


def stop_advice(ckpt_path: str, grace_s: int) -> str:
    """One line for the launcher on the time-limit warning: the last step's phases, the run's
    longest update + sync and save, and whether ``grace_s`` holds them; if not, the warning
    and grace to submit the next run with."""
    try:
        record = json.loads((Path(ckpt_path) / STEP_TIMES_FILE).read_text())
    except (OSError, ValueError):
        return "no step has finished yet: no step times to size the stop with"
    phases = ", ".join(f"{name} {s:.0f}s" for name, s in record["phases_s"].items())
    update, save = record["longest_update_and_sync_s"], record["longest_save_s"]
    said = f"step {record['step']}: {phases}; the run's longest update + sync {update:.0f}s"
    if save is None:
        return f"{said}, no save measured yet"
    needed = update + save + STOP_EXIT_S
    said += f", longest save {save:.0f}s: a stop needs up to about {needed:.0f}s"
    if needed <= grace_s:
        return f"{said}, within STOP_GRACE_S={grace_s}s"
    grace = 60 * -(-int(1.5 * needed) // 60)  # half as much again, in whole minutes
    return (
        f"{said}, more than STOP_GRACE_S={grace_s}s: this stop may come too late; submit "
        f"the next run with sbatch --signal=B:USR1@{grace + AFTER_GRACE_S} and "
        f"STOP_GRACE_S={grace}"
    )
