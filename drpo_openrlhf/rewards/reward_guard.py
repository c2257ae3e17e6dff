"""A reward function that raises, hangs or answers wrongly stops the run; it never trains it.

OpenRLHF's single-turn executor (``utils/agent.py``) calls ``reward_func`` once per response
and swallows any exception at INFO level, leaving that response without a reward; nothing
bounds a call that never returns. DRPO takes ``scores`` as the truth about correctness, so a
missing or made-up score trains the policy against right answers. Two guards:

- in each vLLM engine (``guard_reward_func``): every call runs under a time limit, and an
  exception, a timeout, or an answer without exactly one finite reward and score per query
  is logged as a WARNING with the cause and becomes a NaN reward;
- on the driver (``check_rollout_rewards``): a rollout holding any missing or non-finite
  reward or score stops the run, naming how many and where to read the causes.

The guard also binds the run's reward options (``require_think_end``, the answer format the
entry point decided: ``rewards/answer_format.py``) to the reward function, for those of the
options it accepts by name or through ``**kwargs``: OpenRLHF calls it with the queries,
prompts and labels only, and an engine on another node does not share the driver's
environment.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import threading
import traceback
from collections.abc import Callable, Mapping

import torch

logger = logging.getLogger(__name__)
TIMEOUT_ENV = "DRPO_REWARD_CALL_TIMEOUT_S"
# The project's math grader bounds a call by two 5 s deadlines and a worker's start-up
# (docs/rewards.md; the slowest adversarial answer measured took 5.16 s): 300 s leaves any
# plugin a wide margin and still ends a hang within minutes. A slower plugin sets the
# variable. (``DRPO_REWARD_TIMEOUT_S`` is the math grader's own per-answer deadline.)
DEFAULT_TIMEOUT_S = 300.0


class RewardError(RuntimeError):
    """A rollout with responses the reward function did not score."""


def call_timeout_s() -> float:
    """The time limit of one reward (or positive-reward) call, from ``TIMEOUT_ENV``."""
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def _values(value) -> list[float] | None:
    if isinstance(value, torch.Tensor):
        return value.detach().float().flatten().tolist()
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
        return [float(v) for v in value]
    return None


def answer_problem(answer, expected: int) -> str | None:
    """What is wrong with a ``reward_func`` answer for ``expected`` queries, or None."""
    if not isinstance(answer, dict) or "rewards" not in answer:
        return f"returned {type(answer).__name__}, not a dict with 'rewards'"
    for key in ("rewards", "scores"):
        if key not in answer:
            continue
        values = _values(answer[key])
        if values is None:
            return f"'{key}' is a {type(answer[key]).__name__}, not numbers"
        if len(values) != expected:
            return f"'{key}' holds {len(values)} values for {expected} queries"
        if not all(math.isfinite(v) for v in values):
            return f"'{key}' is not finite: {values}"
    return None


def _call_with_timeout(func: Callable, timeout: float, *args):
    """``func(*args)`` in a daemon thread; ``TimeoutError`` if it has not returned in time
    (the thread cannot be killed: it is left behind, and the run stops)."""
    box: dict = {}

    def target() -> None:
        try:
            box["answer"] = func(*args)
        except BaseException as error:  # reported to the caller, whatever it is
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True, name="reward_func")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"did not return within {timeout:g} s ({TIMEOUT_ENV})")
    if "error" in box:
        raise box["error"]
    return box["answer"]


def accepted_options(reward_func: Callable, options: Mapping[str, object]) -> dict[str, object]:
    """The ``options`` that ``reward_func`` takes as keyword arguments (all of them when it
    has ``**kwargs``; none when its signature cannot be read)."""
    try:
        parameters = inspect.signature(reward_func).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(options)
    named = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {k: v for k, v in options.items() if k in named}


def guard_reward_func(
    reward_func: Callable, timeout: float | None = None, options: Mapping | None = None
) -> Callable:
    """``reward_func`` whose failures become logged NaN rewards (``check_rollout_rewards``
    then stops the run), called with ``options`` as keyword arguments."""
    limit = timeout if timeout is not None else call_timeout_s()
    func = functools.partial(reward_func, **options) if options else reward_func

    def guarded(queries, prompts, labels, **kwargs):
        try:
            answer = _call_with_timeout(func, limit, queries, prompts, labels)
            problem = answer_problem(answer, len(queries))
        except TimeoutError as error:
            problem = str(error)
        except Exception:
            problem = "raised:\n" + traceback.format_exc()
        if problem is None:
            return answer
        prompt = str(prompts[0])[:120] if prompts else ""
        logger.warning("reward_func failed for the prompt %r: %s", prompt, problem)
        nan = torch.full((len(queries),), math.nan)
        return {"rewards": nan, "scores": nan.clone(), "extra_logs": {}}

    return guarded


def guard_engine_rewards(executor, options: Mapping | None = None) -> list[str]:
    """Wrap the reward function of an engine's executor, if it has one (a reward file), with
    the ``options`` it accepts bound; returns their names. Called again, it wraps the
    original function anew (the options replace the earlier ones)."""
    original = getattr(executor, "unguarded_reward_func", None)
    if original is None:
        original = getattr(executor, "reward_func", None)
    if original is None:
        return []
    bound = accepted_options(original, options or {})
    executor.unguarded_reward_func = original
    executor.reward_func = guard_reward_func(original, options=bound)
    return sorted(bound)


class RewardOptionsEngine:
    """Mixin of the vLLM engine actor: ``bind_reward_options`` binds the run's reward
    options in the engine's process (the trainer calls it once before the first rollout)."""

    async def bind_reward_options(self, options: dict) -> list[str]:
        return guard_engine_rewards(self.executor, options)


def check_rollout_rewards(samples: list) -> None:
    """Raise ``RewardError`` if any response of the rollout lacks a finite reward or score."""
    bad, total = 0, 0
    for sample in samples:
        for field in ("rewards", "scores"):
            value = getattr(sample, field)
            if value is None:
                bad += len(sample.prompts)
                break
            if not torch.isfinite(value.float()).all():
                bad += int((~torch.isfinite(value.float())).sum())
                break
        total += len(sample.prompts)
    if bad:
        raise RewardError(
            f"the reward function gave no finite reward or score for {bad} of the rollout's "
            f"{total} responses: its causes are the 'reward_func failed' warnings of the vLLM "
            "engines above (OpenRLHF alone would have trained on them without a reward)"
        )
