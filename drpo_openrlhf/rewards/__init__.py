"""Rule-based rewards: math correctness (math-verify, bounded time) and K&K logic puzzles.

* :mod:`drpo_openrlhf.rewards.math_reward`: ``grade_responses`` (batch API) and the
  OpenRLHF plugin ``reward_func``;
* :mod:`drpo_openrlhf.rewards.kk_reward`: ``grade_kk`` and its ``reward_func``.

Both plugin files can be given to OpenRLHF as ``--reward.remote_url <file>``. Around them,
in the vLLM engines: the reward guard (``reward_guard``: a reward that raises, hangs or
answers wrongly stops the run) and the positive-reward engine (``positive_engine``).

May import ``algo``; never ``update``, ``sync`` or ``runtime`` (checked by ``make lint``).
"""

from drpo_openrlhf.rewards.grading import DEFAULT_TIMEOUT_S, REASONS, GradeResult, grade_responses

__all__ = ["DEFAULT_TIMEOUT_S", "REASONS", "GradeResult", "grade_responses"]
