"""What a run cost to train, read back from its own tensorboard log (``read_scalars``), so a
CPU toy run and a GPU cluster run are measured the same way.

OpenRLHF 0.11.2's ``PPOTrainer.fit``/``train_step`` time each rollout step's phases and log
them as ``train/timing/<phase>``, with ``step_total`` their sum; ``_compute_rollout_stats``
logs the mean response length and the number of responses of each step. Grading has no
phase of its own: the vLLM engines' agent calls the reward function on each response as it
finishes (in a thread, while other responses are still generated), so its time is inside
``generation``. Start-up, checkpoint saves and in-training evaluations are outside
``step_total``. In-training evaluations (``--eval.dataset``, every ``--eval.steps``) are
logged as ``eval/eval_<datasource>_pass1``."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from statistics import fmean
from typing import Any

Logged = Mapping[str, Mapping[int, float]]

TIMING = "train/timing/"
STEP_TOTAL = TIMING + "step_total"
# phase -> what it holds (OpenRLHF's names; make_experience is mostly the actor's log-probs)
PHASES = {
    "generation": "generation (with grading)",
    "make_experience": "log-probs",
    "ppo_train": "actor update",
    "broadcast": "weight sync",
}
RESPONSE_LENGTH = "train/rollout/response_length_mean"
RESPONSES = "train/rollout/num_samples"
EVAL_PASS1 = re.compile(r"eval/eval_(.+)_pass1")


def step_seconds(logged: Logged) -> dict[int, float]:
    """Each logged step's wall time, all phases together."""
    return dict(logged.get(STEP_TOTAL, {}))


def step_tokens(logged: Logged) -> dict[int, float]:
    """Response tokens generated at each step (mean length x responses; EOS included, as
    OpenRLHF counts the response)."""
    lengths, counts = logged.get(RESPONSE_LENGTH, {}), logged.get(RESPONSES, {})
    return {step: lengths[step] * counts[step] for step in lengths if step in counts}


def eval_accuracy(logged: Logged, datasets: Sequence[str] | None = None) -> dict[int, float]:
    """In-training pass@1 per evaluated step: the unweighted mean over datasources (as
    drpo-eval's ``average``), over ``datasets`` only when given and logged."""
    per_source: dict[str, Mapping[int, float]] = {}
    for tag, values in logged.items():
        found = EVAL_PASS1.fullmatch(tag)
        if found:
            per_source[found.group(1)] = values
    if datasets is not None and any(d in per_source for d in datasets):
        per_source = {d: per_source[d] for d in datasets if d in per_source}
    steps = set.intersection(*(set(v) for v in per_source.values())) if per_source else set()
    return {step: fmean(v[step] for v in per_source.values()) for step in sorted(steps)}


def training_cost(logged: Logged, datasets: Sequence[str] | None = None) -> dict[str, Any] | None:
    """The run's tokens, seconds and seconds per phase summed over its logged steps, and the
    in-training evaluations with the tokens and seconds spent up to each; None without step
    timing. ``missing_steps`` are steps before the last without a record (e.g.
    ``--logger.logging_steps`` > 1): the sums then leave them out, and say so."""
    seconds = step_seconds(logged)
    if not seconds:
        return None
    steps = sorted(seconds)
    tokens = step_tokens(logged)
    has_tokens = all(step in tokens for step in steps)
    phases = {}
    for phase in PHASES:
        values = logged.get(TIMING + phase, {})
        phases[phase] = sum(values.get(s, 0.0) for s in steps) if values else None
    curve = []
    for step, accuracy in eval_accuracy(logged, datasets).items():
        done = [s for s in steps if s <= step]
        curve.append(
            {
                "step": step,
                "pass@1": accuracy,
                "tokens": sum(tokens[s] for s in done) if has_tokens else None,
                "seconds": sum(seconds[s] for s in done),
            }
        )
    return {
        "steps": len(steps),
        "missing_steps": [s for s in range(1, steps[-1]) if s not in seconds],
        "tokens": sum(tokens[s] for s in steps) if has_tokens else None,
        "seconds": sum(seconds.values()),
        "phases_s": phases,
        "evaluations": curve,
    }


def first_reaching(cost: Mapping[str, Any], target: float) -> dict[str, Any] | None:
    """The first in-training evaluation at or above ``target``, with the tokens and seconds
    spent until it; None if none did."""
    return next((point for point in cost["evaluations"] if point["pass@1"] >= target), None)


def summary(cost: Mapping[str, Any] | None, target: float | None = None) -> list[str]:
    """``drpo-eval cost``'s lines for one run: the totals and phase shares, each in-training
    evaluation with what was spent until it, and the first that reached ``target``."""
    if cost is None:
        return [f"no step timing logged ({STEP_TOTAL} missing)"]
    tokens = "tokens not logged" if cost["tokens"] is None else f"{cost['tokens']:.0f} tokens"
    shares = [
        f"{label} {'not logged' if s is None else format(s / cost['seconds'], '.0%')}"
        for phase, label in PHASES.items()
        for s in [cost["phases_s"][phase]]
    ]
    lines = [f"{cost['steps']} steps, {tokens}, {cost['seconds']:.1f} s: {', '.join(shares)}"]
    if cost["missing_steps"]:
        lines.append(f"steps not logged (left out): {cost['missing_steps']}")
    for point in cost["evaluations"]:
        spent = "" if point["tokens"] is None else f"{point['tokens']:.0f} tokens, "
        lines.append(
            f"eval at step {point['step']}: pass@1 {point['pass@1']:.1%} after "
            f"{spent}{point['seconds']:.1f} s"
        )
    if target is not None:
        if not cost["evaluations"]:
            lines.append("no in-training evaluations to compare with the target")
        else:
            reached = first_reaching(cost, target)
            lines.append(
                f"first at or above {target:.1%}: "
                + (f"step {reached['step']}" if reached else "not reached")
            )
    return lines
