"""One line per rollout step on the driver, and the stop of a run that cannot learn.

A rollout in which no prompt group can teach the update anything (every response wrong, every
group all correct) trains nothing, and OpenRLHF goes on logging zeros for as long as the job
lasts. So the driver prints, for every rollout before its update, the share of each reason the
reward function gave (its per-response 0/1 ``extra_logs``, ``prefix/reason``) and how many
prompt groups the update can learn from, by the algorithm's own rule (``algo.learnable`` for
DRPO; for the baselines, groups whose shaped rewards differ: ``algo.advantages``). A rollout
with none, or with fewer groups than one DRPO optimizer step takes, says why and what to
change; after ``--drpo.max_steps_without_signal`` such rollouts in a row the run stops, before
that rollout's update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from drpo_openrlhf.algo.advantages import has_relative_signal
from drpo_openrlhf.algo.config import DRPOConfig
from drpo_openrlhf.algo.learnable import learnable_groups, unlearnable_counts
from drpo_openrlhf.update.keys import GROUP_KEY, correctness

FLAG = "--drpo.max_steps_without_signal"
DEFAULT_LIMIT = 3
# OpenRLHF's estimators that compare each response with its own group only: a group whose
# rewards are all equal gets zero advantages under them (the others compare across the batch)
GROUP_RELATIVE_ESTIMATORS = frozenset({"rloo", "group_norm", "dr_grpo", "reinforce_baseline"})
SHAPED_KEY = "shaped_reward"  # ``update/baseline_experience.py``'s column of a baseline's rewards

# What to change when wrong answers fail for a reward function's reason (math_reward.py's and
# kk_reward.py's reasons, docs/rewards.md); a reason without an entry is named without a fix.
FIXES = {
    "no_think_end": "no '</think>' in the responses: a model that does not think needs "
    "--drpo.answer_format plain",
    "no_boxed": "no \\boxed{} answer: ask for the final answer in \\boxed{} in the prompt "
    "(or --data.input_template)",
    "unparsable": "empty \\boxed{}: check the answer format the prompt asks for",
    "too_long": "boxed answers too long to grade: check the answer format the prompt asks for",
    "incomplete": "answers that leave people out: check the answer format the prompt asks for",
    "wrong": "the prompts are too hard for this model: easier prompts, a stronger model or "
    "more samples per prompt (--rollout.n_samples_per_prompt)",
    "text_mismatch": "answers that do not match a text label: check the labels' form",
    "bad_label": "labels the grader cannot read: check the data (drpo-data audit FILE)",
    "timeout": "the grader ran out of time: DRPO_REWARD_TIMEOUT_S",
    "error": "the reward function failed: see the vLLM engines' warnings",
    "prompt_not_found": "the reward function did not find the prompt in the decoded text "
    "(chat template or tokenizer)",
}
TRUNCATED_FIX = "raise --rollout.max_new_tokens"
MAX_FIXES = 3


class NoLearningSignalError(RuntimeError):
    """Rollout after rollout, no prompt group gave the update anything to learn from."""

    # for ``checkpoints.stop_message``: rerunning the same command would stop the same way
    resume_advice = "rerun with the change this line names and --ckpt.load_enable to resume from it"


def percent(share: float) -> str:
    """A share as a whole percentage that never shows a rare case as 0% or a near-total one as
    100%."""
    if 0 < share < 0.005:
        return "<1%"
    if 0.995 <= share < 1:
        return ">99%"
    return f"{100 * share:.0f}%"


def _column(value) -> Tensor:
    """An ``experience.info`` entry as a flat float tensor (OpenRLHF keeps a tensor, or a
    list of per-response tensors after a split)."""
    if isinstance(value, list):
        return torch.cat([torch.as_tensor(v).reshape(-1) for v in value]).double()
    return torch.as_tensor(value).reshape(-1).double()


def indicator_columns(infos: Sequence[Mapping], sizes: Sequence[int]) -> dict[str, Tensor]:
    """The 0/1 columns ``prefix/name`` that every experience's ``info`` holds for each of its
    responses (a reward plugin's ``extra_logs``: reasons and flags), concatenated."""
    if not infos:
        return {}
    columns = {}
    for key in infos[0]:
        if "/" not in key or not all(key in info for info in infos):
            continue
        parts = [_column(info[key]) for info in infos]
        if [p.numel() for p in parts] != list(sizes):
            continue
        column = torch.cat(parts)
        if bool(((column == 0) | (column == 1)).all()):
            columns[key] = column
    return columns


def reason_shares(columns: Mapping[str, Tensor], among: Tensor) -> dict[str, dict[str, float]]:
    """``prefix -> name -> share`` of the responses where ``among`` holds, for every column
    with a share above 0 (largest first)."""
    total = int(among.sum())
    if total == 0:
        return {}
    shares: dict[str, dict[str, float]] = {}
    for key in sorted(columns):
        prefix, _, name = key.rpartition("/")
        share = float(columns[key][among].sum()) / total
        if share > 0:
            shares.setdefault(prefix, {})[name] = share
    return {
        prefix: dict(sorted(names.items(), key=lambda item: (-item[1], item[0])))
        for prefix, names in shares.items()
    }


def format_shares(shares: Mapping[str, Mapping[str, float]]) -> str:
    """``math: no_boxed 60%, ok 25%, wrong 15%`` (prefixes separated by ``; ``)."""
    return "; ".join(
        f"{prefix}: " + ", ".join(f"{name} {percent(s)}" for name, s in names.items())
        for prefix, names in shares.items()
    )


@dataclass(frozen=True)
class RolloutSignal:
    """What a rollout gives the update, as the step line and the stop report it.

    ``learnable`` is ``None`` where no group rule applies (a baseline under an estimator that
    compares across the batch). ``wrong_reasons`` and ``truncated_wrong`` are taken over the
    incorrect responses only; ``all_correct_fix`` is what to change about all-correct groups
    in this run. ``groups_per_step`` is the prompt groups of one DRPO optimizer step
    (``--train.batch_size / n``; None for the baselines, whose update takes any count): the
    update trains on whole steps only, so a rollout of fewer groups trains on none of them,
    whatever they hold (a short last rollout, or dynamic filtering out of prompts to refill).
    """

    responses: int
    correct: float
    groups: int
    learnable: int | None
    all_correct: int
    all_wrong: int
    reasons: dict[str, dict[str, float]]
    wrong_reasons: dict[str, dict[str, float]]
    truncated_wrong: float
    all_correct_fix: str
    groups_per_step: int | None = None

    @property
    def short(self) -> bool:
        """Too few groups for one optimizer step: the update trains on nothing."""
        return self.groups_per_step is not None and self.groups < self.groups_per_step

    @property
    def without_signal(self) -> bool:
        return self.learnable == 0 or self.short

    def diagnosis(self) -> str:
        """Why no group can teach the update anything, and what to change."""
        if self.short:
            return (
                f"the rollout holds {self.groups} prompt group{'s' * (self.groups != 1)}, "
                f"fewer than the {self.groups_per_step} of one optimizer step (--train.batch_size "
                "/ --rollout.n_samples_per_prompt), so the update trains on none of them: "
                "under dynamic filtering, prompts to refill from (more prompts than "
                "--rollout.batch_size) or a smaller --train.batch_size"
            )
        parts = []
        if self.all_wrong:
            said = f"{self.all_wrong} of {self.groups} groups all wrong"
            if self.wrong_reasons:
                said += f" ({format_shares(self.wrong_reasons)})"
            parts.append(said + ": " + "; ".join(self._wrong_fixes()))
        if self.all_correct:
            parts.append(
                f"{self.all_correct} of {self.groups} groups all correct: {self.all_correct_fix}"
            )
        rest = self.groups - self.all_wrong - self.all_correct
        if rest:
            parts.append(f"{rest} of {self.groups} groups with equal shaped rewards")
        return "; ".join(parts)

    def _wrong_fixes(self) -> list[str]:
        fixes = []
        truncated = f"{percent(self.truncated_wrong)} of them truncated: {TRUNCATED_FIX}"
        if self.truncated_wrong >= 0.5:
            fixes.append(truncated)
        ranked = sorted(
            ((s, name) for names in self.wrong_reasons.values() for name, s in names.items()),
            key=lambda item: (-item[0], item[1]),
        )
        for _, name in ranked:
            fix = f"{name}: {FIXES[name]}" if name in FIXES else None
            if fix and fix not in fixes and len(fixes) < MAX_FIXES:
                fixes.append(fix)
        if 0 < self.truncated_wrong < 0.5:
            fixes.append(truncated)
        return fixes or ["see the reward function's reasons"]


def _group_ids(experiences: Sequence, n_samples: int, tag: str | None) -> Tensor:
    """Each response's prompt group: DRPO's ``tag`` (``GroupTaggingExperienceMaker``), or the
    rollout index over ``n`` (the baselines' experiences keep OpenRLHF's index)."""
    if tag is not None:
        return torch.cat([_column(e.info[tag]) for e in experiences]).long()
    return torch.tensor([i for e in experiences for i in e.index], dtype=torch.long) // n_samples


def _baseline_learnable(experiences: Sequence, group_ids: Tensor, estimator: str) -> int | None:
    if estimator not in GROUP_RELATIVE_ESTIMATORS:
        return None
    shaped = torch.cat([_column(e.info[SHAPED_KEY]) for e in experiences])
    return sum(
        has_relative_signal(shaped[group_ids == g].tolist()) for g in group_ids.unique().tolist()
    )


def rollout_signal(
    experiences: Sequence,
    config: DRPOConfig | None,
    n_samples: int,
    estimator: str = "",
    group_ids: Tensor | None = None,
    groups_per_step: int | None = None,
) -> RolloutSignal:
    """A rollout's ``RolloutSignal``: DRPO's groups under ``config``, or, with ``config``
    None, a baseline's under OpenRLHF's advantage ``estimator``. ``group_ids`` (one per
    response) stand in for the groups' tags where none were written yet (the samples
    generator's responses: ``runtime/dynamic_filter.py``); ``groups_per_step`` as in
    ``RolloutSignal``."""
    sizes = [e.scores.numel() for e in experiences]
    correct = correctness(torch.cat([e.scores.reshape(-1) for e in experiences]))
    if group_ids is None:
        group_ids = _group_ids(experiences, n_samples, None if config is None else GROUP_KEY)
    if config is None:
        learnable = _baseline_learnable(experiences, group_ids, estimator)
        all_correct_fix = "harder prompts"
    else:
        learnable = int(learnable_groups(correct, group_ids, config).sum())
        all_correct_fix = "harder prompts"
        if not config.all_correct_length_signal:
            all_correct_fix += ", or --drpo.all_correct_length_signal to learn concision from them"
        elif math.isinf(config.lam):
            all_correct_fix += " (under lambda inf their length signal is 0)"
    all_correct, all_wrong = unlearnable_counts(correct, group_ids)
    columns = indicator_columns([e.info for e in experiences], sizes)
    wrong = ~correct
    truncated = [e.truncated for e in experiences]
    truncated_wrong = 0.0
    if wrong.any() and all(t is not None for t in truncated):
        flags = torch.cat([t.reshape(-1) for t in truncated]).bool()
        truncated_wrong = float(flags[wrong].sum()) / int(wrong.sum())
    return RolloutSignal(
        responses=correct.numel(),
        correct=float(correct.double().mean()),
        groups=int(group_ids.unique().numel()),
        learnable=learnable,
        all_correct=all_correct,
        all_wrong=all_wrong,
        reasons=reason_shares(columns, torch.ones_like(correct)),
        wrong_reasons=reason_shares(columns, wrong),
        truncated_wrong=truncated_wrong,
        all_correct_fix=all_correct_fix,
        groups_per_step=groups_per_step,
    )


class SignalWatch:
    """Counts the rollouts in a row without a learnable group; ``check`` stops the run at
    ``limit`` of them (0: never). The count lives in the driver's trainer and starts afresh
    with each process (a resume): the command is often changed in between, and a rollout
    with a learnable group resets it anyway."""

    def __init__(self, limit: int):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"{FLAG} must be an integer >= 0, got {limit!r}")
        self.limit = limit
        self.streak = 0
        self._last: RolloutSignal | None = None

    def observe(self, step: int, rollout: RolloutSignal, note: str | None = None) -> str:
        """Count ``rollout`` and return its step line; ``note`` follows the group count (what
        dynamic filtering dropped to fill the rollout)."""
        self.streak = self.streak + 1 if rollout.without_signal else 0
        self._last = rollout
        learnable = "?" if rollout.learnable is None else rollout.learnable
        line = f"step {step}: correct {percent(rollout.correct)}"
        line += f", learnable groups {learnable}/{rollout.groups}"
        if note:
            line += f", {note}"
        if rollout.reasons:
            line += f" | {format_shares(rollout.reasons)}"
        if not rollout.without_signal:
            return line
        if self.limit:
            count = f"{self.streak} of {self.limit} in a row before the run stops, {FLAG}"
        else:
            count = f"{self.streak} in a row; {FLAG} 0: no stop"
        return f"{line} | no learning signal ({count}): {rollout.diagnosis()}"

    def check(self) -> None:
        """Raise ``NoLearningSignalError`` once ``limit`` rollouts in a row had no signal."""
        if self.limit and self.streak >= self.limit and self._last is not None:
            raise NoLearningSignalError(
                f"no prompt group to learn from in {self.streak} rollouts in a row "
                f"({FLAG} {self.limit}; 0 turns this stop off): {self._last.diagnosis()}"
            )

    def stats(self) -> dict[str, float]:
        """What the step logs: the share of learnable groups and the count so far."""
        stats = {"rollout/steps_without_signal": float(self.streak)}
        last = self._last
        if last is not None and last.learnable is not None and last.groups:
            stats["rollout/learnable_group_fraction"] = last.learnable / last.groups
        return stats
