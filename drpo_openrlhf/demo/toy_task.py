"""A toy task on which response length and correctness really trade off.

Problems are sums of 2 to 4 numbers (``Compute 23+5+41.``). The reasoning traces a tiny
model is fine-tuned on have the shape of the paper's rollouts::

    <think>
    23+5=28
    28+41=69
    Wait, let me check.          <- redundant re-checks, a random number of them
    23+5=28
    28+41=69
    </think>
    \\boxed{69}

Re-checks repeat the computation verbatim, so they cost length and buy nothing: an RL method
can cut them for free. A fraction of traces skip the steps (``<think>\\n</think>`` and the
answer at once). A tiny model answers a two-number sum directly as well as with its one
step, but cannot add three or four numbers in its head: skipping is a length cut that costs
accuracy on hard items. Both kinds of shortening are available to the fine-tuned policy; a
method that respects correctness should take the first and avoid the second.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RECHECK = "Wait, let me check.\n"


@dataclass(frozen=True)
class ToyTaskConfig:
    """Problem distribution and trace style.

    ``max_rechecks``: each trace re-checks a uniform 0..max_rechecks times.
    ``skip_prob``: share of traces that answer without steps.
    """

    min_terms: int = 2
    max_terms: int = 4
    max_operand: int = 9
    max_rechecks: int = 3
    skip_prob: float = 0.2

    def __post_init__(self) -> None:
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError("need 2 <= min_terms <= max_terms")
        if self.max_operand < 1 or self.max_rechecks < 0 or not 0 <= self.skip_prob <= 1:
            raise ValueError("need max_operand >= 1, max_rechecks >= 0, 0 <= skip_prob <= 1")


@dataclass(frozen=True)
class ToyProblem:
    operands: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return f"Compute {'+'.join(map(str, self.operands))}."

    @property
    def label(self) -> str:
        return str(sum(self.operands))

    @property
    def datasource(self) -> str:
        """One evaluation dataset per number of terms, so difficulty shows in the tables."""
        return f"add{len(self.operands)}"

    def steps(self) -> list[str]:
        """The running sums ``a+b=c``, one line per needed step."""
        lines, total = [], self.operands[0]
        for x in self.operands[1:]:
            lines.append(f"{total}+{x}={total + x}")
            total += x
        return lines


def render_trace(problem: ToyProblem, rechecks: int, skip: bool) -> str:
    """A response in the paper's shape: ``<think> ... </think>`` then the boxed answer."""
    body = ""
    if not skip:
        work = "".join(f"{line}\n" for line in problem.steps())
        body = work + (RECHECK + work) * rechecks
    return f"<think>\n{body}</think>\n\\boxed{{{problem.label}}}"


def response_shape(text: str) -> tuple[bool, int]:
    """How a response is long: ``(skipped the steps, number of re-checks)``. A response
    without ``</think>`` (truncated) did not skip."""
    thinking, closed, _ = text.partition("</think>")
    skipped = bool(closed) and not thinking.removeprefix("<think>").strip()
    return skipped, thinking.count(RECHECK.strip())


def sample_problem(rng: random.Random, config: ToyTaskConfig) -> ToyProblem:
    terms = rng.randint(config.min_terms, config.max_terms)
    return ToyProblem(tuple(rng.randint(1, config.max_operand) for _ in range(terms)))


def sample_traces(
    rng: random.Random, config: ToyTaskConfig, problems: list[ToyProblem]
) -> Iterator[tuple[str, str]]:
    """Endless ``(prompt, response)`` SFT pairs drawn from ``problems``."""
    while True:
        problem = rng.choice(problems)
        skip = rng.random() < config.skip_prob
        rechecks = rng.randint(0, config.max_rechecks)
        yield problem.prompt, render_trace(problem, rechecks, skip)


def write_jsonl(problems: list[ToyProblem], path: str | Path) -> Path:
    """Rows ``{"prompt", "label", "datasource"}``, the format of ``drpo-data``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for p in problems:
            row = {"prompt": p.prompt, "label": p.label, "datasource": p.datasource}
            handle.write(json.dumps(row) + "\n")
    return path
