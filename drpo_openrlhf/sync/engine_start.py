"""A vLLM engine that fails to start stops the run at once, naming the engine and its error.

OpenRLHF 0.11.2 creates its engines as Ray actors and does not wait for them
(``create_vllm_engines``). The first process to need them is actor rank 0, whose weight-sync
group (``ActorPPOTrainer._init_vllm_sync_group``) waits for every engine to join it: for the
TCP store's timeout on CPU (``gloo_group.SYNC_TIMEOUT``, 10 minutes), and on GPU in vLLM's
``StatelessProcessGroup``. An engine that died while starting never joins, so the run hung
silently. Here rank 0 first waits for every engine's start to finish, and stops on the first
that failed with ``EngineStartError``, whose message ends in the engine's own error (or on
engines still starting after ``START_TIMEOUT_S``).
"""

from __future__ import annotations

import re
import time

from drpo_openrlhf import upstream

CREATION_FAILED = "error raised in its creation task"
# An engine loads its model and, on GPU, captures CUDA graphs: minutes for 8B weights on a slow
# shared file system. Beyond this it is taken to hang (before, only the sync group's own
# timeout bounded it: 10 minutes on CPU, 5 in vLLM's StatelessProcessGroup on GPU).
START_TIMEOUT_S = 1800.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class EngineStartError(RuntimeError):
    """A vLLM engine's start-up (its Ray actor's ``__init__``) failed."""


def creation_error(error: BaseException) -> str | None:
    """``"ValueError: ..."``, the last line of the error a Ray actor's ``__init__`` raised, as
    Ray reports it; None for any other error (an actor killed later, a task's error)."""
    text = ANSI.sub("", str(error)).strip()
    if CREATION_FAILED not in text:
        return None
    return text.splitlines()[-1].strip()


def start_failure(error: BaseException) -> str | None:
    """``"a vLLM engine failed to start: ValueError: ..."`` (or the actor class Ray names)
    when ``error`` is a Ray actor's failed start; None otherwise."""
    own = creation_error(error)
    if own is None:
        return None
    waited = re.match(rf"(?:[\w.]+\.)?({EngineStartError.__name__}: .*)", own)
    if waited:  # an actor that waited for the engines: Ray names the error with its module
        return waited.group(1)
    actor = re.search(r"ray::(\w+)\.__init__", ANSI.sub("", str(error)))
    if actor is None:
        who = "a Ray actor"
    elif "RolloutRayActor" in actor.group(1):
        who = "a vLLM engine"
    else:
        who = f"the Ray actor {actor.group(1)}"
    return f"{who} failed to start: {own}"


def wait_for_engines(engines: list, timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once every engine has started; raise ``EngineStartError`` on the first whose
    start failed (in the order they finish, so a failure is not held up by a slow start), or
    when some have not started within ``timeout_s``."""
    import ray
    from ray.exceptions import RayActorError

    pending = {engine.get_num_unfinished_requests.remote(): i for i, engine in enumerate(engines)}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        if not ready:
            late = sorted(pending.values())
            raise EngineStartError(
                f"vLLM engine(s) {late} of {len(engines)} did not start within {timeout_s:g} s"
            )
        index = pending.pop(ready[0])
        try:
            ray.get(ready[0])
        except RayActorError as error:
            cause = creation_error(error) or str(error).strip().splitlines()[0]
            raise EngineStartError(
                f"vLLM engine {index} of {len(engines)} failed to start: {cause}"
            ) from None


def install() -> None:
    """Make actor rank 0 wait for the engines before it opens the weight-sync group (in the
    actor's process; idempotent)."""
    upstream.apply("policy_actor", {"ActorPPOTrainer._init_vllm_sync_group": _after_the_engines})


def _after_the_engines(opening):
    def open_after_the_engines_started(self, backend: str) -> None:
        wait_for_engines(self.vllm_engines)
        opening(self, backend)

    return open_after_the_engines_started
