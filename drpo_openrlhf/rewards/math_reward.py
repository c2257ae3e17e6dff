"""Math correctness reward: OpenRLHF plugin and batch API.

As an OpenRLHF reward plugin (also with stock OpenRLHF 0.11.2)::

    --reward.remote_url /path/to/drpo_openrlhf/rewards/math_reward.py

OpenRLHF loads this file by path and calls :func:`reward_func` from worker threads. The
file works when loaded that way even if ``drpo_openrlhf`` is not installed: it then puts
its checkout on ``sys.path``.

The answer is the text after ``</think>`` for a thinking model (a response without one
scores 0, ``no_think_end``); for a model that does not think (``require_think_end=False``)
it is the whole response, or the text after a ``</think>`` if one is written. Our entry
point decides which from the model's chat template (``--drpo.answer_format``,
:mod:`drpo_openrlhf.rewards.answer_format`) and passes ``require_think_end`` to this
function in every vLLM engine. With stock OpenRLHF, which passes no options, they are read
per call from the environment of the process that runs the plugin (the vLLM engine actors):

* ``DRPO_REWARD_REQUIRE_THINK_END=0`` for non-thinking models (default ``1``);
* ``DRPO_REWARD_TIMEOUT_S`` per-response deadline (default ``DEFAULT_TIMEOUT_S``);
* ``DRPO_REWARD_WORKERS`` grader processes per calling process (default ``min(4, CPUs)``).

The batch API for other modules is :func:`grade_responses` (see
:mod:`drpo_openrlhf.rewards.grading` for the rules and reasons).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

try:
    import drpo_openrlhf.rewards.grading  # noqa: F401
except ImportError:  # loaded by path from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from drpo_openrlhf.rewards._plugin import (
    as_list,
    build_output,
    env_flag,
    query_count,
    responses_from_queries,
)
from drpo_openrlhf.rewards.grading import (
    DEFAULT_TIMEOUT_S,
    MAX_ANSWER_CHARS,
    REASONS,
    GradeResult,
    env_timeout_s,
    grade_responses,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "LOG_PREFIX",
    "MAX_ANSWER_CHARS",
    "REASONS",
    "GradeResult",
    "grade_responses",
    "reward_func",
]

LOG_PREFIX = "math"


def reward_func(queries, prompts, labels, **kwargs) -> dict:
    """OpenRLHF reward plugin: 1.0 for a correct final boxed answer, else 0.0.

    ``queries`` are prompt + response as OpenRLHF decodes them; the response is cut out
    of each query with its prompt. Returns ``{"rewards", "scores", "extra_logs"}`` where
    ``extra_logs`` has a per-sample 0/1 tensor ``math/<reason>`` for every reason in
    ``REASONS``, plus ``math/prompt_not_found`` and ``math/seconds`` (wall time of the
    call). Never raises: any failure scores 0 with reason ``error``.

    Keyword options (our entry point binds ``require_think_end``; stock OpenRLHF passes
    none): ``require_think_end`` and ``timeout_s``; they default to the environment settings.
    """
    start = time.perf_counter()
    queries, n = query_count(queries)
    found = [False] * n
    try:
        require_think_end = kwargs.get("require_think_end")
        if require_think_end is None:
            require_think_end = env_flag("DRPO_REWARD_REQUIRE_THINK_END", True)
        timeout_s = kwargs.get("timeout_s") or env_timeout_s()
        responses, found = responses_from_queries(queries, as_list(prompts, n))
        results = grade_responses(
            responses,
            as_list(labels, n),
            require_think_end=bool(require_think_end),
            timeout_s=timeout_s,
        )
    except Exception:
        results = [GradeResult(False, "error")] * n
    elapsed = time.perf_counter() - start
    return build_output(
        [r.correct for r in results],
        [r.reason for r in results],
        LOG_PREFIX,
        REASONS,
        {"prompt_not_found": [0.0 if f else 1.0 for f in found], "seconds": [elapsed] * n},
    )
