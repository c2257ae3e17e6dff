"""``--algo.dynamic_filtering_enable`` under DRPO: a rollout made only of the prompt groups the
update learns from, refilled from new prompts.

OpenRLHF's filter (``samples_generator.py``, ``_generate_vllm``) keeps a prompt group when the
mean of its reward ``scores`` lies strictly inside ``--algo.dynamic_filtering_range`` (0, 1 by
default): DAPO's dynamic sampling, the mixed groups for 0/1 scores. That is not what DRPO's
objective learns from under its options: all-wrong groups too under ``--drpo.keep_all_wrong``,
all-correct ones under ``--drpo.all_correct_length_signal`` with a finite lambda. So a DRPO run
keeps exactly the groups ``algo.learnable.learnable_groups`` says the objective learns from,
on the correctness the update reads (``update.keys.correctness``: a score of 1, anything but
0/1 refused), and a range given with the flag must say the same or is refused before launch
(``check_range``). A baseline (``--shaping.method``) keeps OpenRLHF's meaning: which groups its
PPO loss learns from depends on length-shaped rewards computed after generation (HAPO's from
a history each shaping updates), so the filter there is what the user asks of the range.

Generation runs in rounds: OpenRLHF's own ``_generate_vllm``, unfiltered, generates a round;
the rule picks its groups; the next round asks for as many new prompts as groups are missing,
until the rollout is full or the data runs out. OpenRLHF dispatches each replacement as soon as
a group is dropped; both consume the same prompts in the dataloader's order (the shortest run
of prompts holding a full rollout's kept groups) and keep the same groups. A run whose prompts
yield nothing to keep stops after ``--drpo.max_steps_without_signal`` rollouts' worth of
prompts in a row without a kept group (``RefillWatch``), where OpenRLHF would go through the
whole dataset, every episode, training on nothing.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from drpo_openrlhf.algo.config import DRPOConfig
from drpo_openrlhf.algo.learnable import learnable_groups
from drpo_openrlhf.flags import flag
from drpo_openrlhf.rewards.reward_guard import check_rollout_rewards
from drpo_openrlhf.update.keys import correctness
from drpo_openrlhf.update.signal_watch import FLAG as WITHOUT_SIGNAL_FLAG
from drpo_openrlhf.update.signal_watch import NoLearningSignalError, percent, rollout_signal

ENABLE = "--algo.dynamic_filtering_enable"
RANGE = "--algo.dynamic_filtering_range"


def outcome(k: int, n: int) -> str:
    """A group of ``n`` responses with ``k`` correct, in words."""
    if k == 0:
        return "all wrong"
    return "all correct" if k == n else f"{k} of {n} correct"


def drpo_keeps(config: DRPOConfig, n: int) -> list[bool]:
    """For k = 0..n: whether DRPO's update under ``config`` learns from a group of ``n``
    responses with ``k`` correct (``learnable_groups``, the objective's own rule)."""
    correct = torch.tensor([i < k for k in range(n + 1) for i in range(n)])
    return learnable_groups(correct, torch.arange(n + 1).repeat_interleave(n), config).tolist()


def range_keeps(score_range: Sequence[float], n: int) -> list[bool]:
    """For k = 0..n: whether OpenRLHF's filter keeps a group of ``n`` 0/1 scores with ``k``
    ones: their mean strictly inside ``score_range``."""
    lo, hi = score_range
    return [lo < k / n < hi for k in range(n + 1)]


def rule_words(config: DRPOConfig) -> str:
    """The groups DRPO's update learns from under ``config``, in words."""
    kinds = ["mixed"]
    if config.keep_all_wrong:
        kinds.append("all wrong (--drpo.keep_all_wrong)")
    if drpo_keeps(config, 2)[-1]:
        kinds.append("all correct (--drpo.all_correct_length_signal)")
    return ", ".join(kinds)


def range_mismatch(score_range: Sequence[float], config: DRPOConfig, n: int) -> str | None:
    """Why ``score_range`` is not DRPO's rule for groups of ``n`` under ``config`` (which
    learnable groups it would drop, which unlearnable ones it would keep), or None."""
    ours, theirs = drpo_keeps(config, n), range_keeps(score_range, n)
    dropped = [outcome(k, n) for k in range(n + 1) if ours[k] and not theirs[k]]
    kept = [outcome(k, n) for k in range(n + 1) if theirs[k] and not ours[k]]
    if not dropped and not kept:
        return None
    said = []
    if dropped:
        said.append(f"drop groups DRPO's update learns from ({', '.join(dropped)})")
    if kept:
        said.append(f"keep groups it cannot learn from ({', '.join(kept)})")
    lo, hi = -1 if ours[0] else 0, 2 if ours[-1] else 1
    return (
        f"{RANGE} {score_range[0]:g} {score_range[1]:g} would {' and '.join(said)} in groups "
        f"of {n}: under DRPO the filter keeps the groups the objective learns from "
        f"({rule_words(config)}); drop {RANGE}, or give a range that keeps exactly those "
        f"({RANGE} {lo} {hi})"
    )


def check_range(args: argparse.Namespace, config: DRPOConfig, given: bool) -> None:
    """Refuse a ``--algo.dynamic_filtering_range`` the run would not apply as given: one
    without the filter, or (DRPO) one other than DRPO's rule. Raises ``ValueError``."""
    if not flag(args, "algo.dynamic_filtering_enable"):
        if given:
            raise ValueError(f"{RANGE} does nothing without {ENABLE}: add it, or drop the range")
        return
    if not given or flag(args, "shaping.method"):  # a baseline's range means OpenRLHF's
        return
    n = flag(args, "rollout.n_samples_per_prompt")
    problem = range_mismatch(tuple(flag(args, "algo.dynamic_filtering_range")), config, n)
    if problem:
        raise ValueError(problem)


@dataclass(frozen=True)
class GroupFilter:
    """Which prompt groups a rollout keeps: DRPO's rule under ``config``, or, ``config`` None
    (a baseline), OpenRLHF's: the mean of the group's scores strictly inside
    ``score_range``. ``n``: responses per group."""

    config: DRPOConfig | None
    score_range: tuple[float, float]
    n: int

    def keeps(self, experiences: Sequence) -> list[bool]:
        """Per group of the single-response ``experiences`` (a prompt's ``n`` consecutive):
        whether the rollout keeps it. A response without a finite score stops the run
        (``RewardError``), as it would at the update."""
        check_rollout_rewards(experiences)
        scores = torch.cat([e.scores.reshape(-1) for e in experiences])
        if self.config is None:
            lo, hi = self.score_range
            groups = scores.reshape(-1, self.n).tolist()
            return [lo < sum(group) / len(group) < hi for group in groups]
        group_ids = torch.arange(scores.numel() // self.n).repeat_interleave(self.n)
        return learnable_groups(correctness(scores), group_ids, self.config).tolist()

    def diagnosis(self, experiences: Sequence) -> str:
        """Why none of these groups was kept, and what to change."""
        groups = len(experiences) // self.n
        if self.config is not None:
            group_ids = torch.arange(groups).repeat_interleave(self.n)
            signal = rollout_signal(experiences, self.config, self.n, group_ids=group_ids)
            return signal.diagnosis()
        lo, hi = self.score_range
        return f"{groups} groups' mean score outside {RANGE} ({lo:g}, {hi:g})"


@dataclass
class FilterReport:
    """What filling one rollout took: prompts generated and kept, their responses, rounds,
    and the dropped groups by outcome (``other``: a baseline's range dropped a mixed one)."""

    prompts_generated: int = 0
    prompts_kept: int = 0
    samples_generated: int = 0
    rounds: int = 0
    all_wrong: int = 0
    all_correct: int = 0
    other: int = 0

    @property
    def dropped(self) -> int:
        return self.prompts_generated - self.prompts_kept

    @property
    def pass_rate(self) -> float:
        return self.prompts_kept / self.prompts_generated if self.prompts_generated else 0.0

    def count(self, groups: Sequence[Sequence], keeps: Sequence[bool]) -> None:
        self.rounds += 1
        self.prompts_generated += len(groups)
        self.prompts_kept += sum(keeps)
        for group, keep in zip(groups, keeps, strict=True):
            self.samples_generated += len(group)
            if keep:
                continue
            scores = torch.cat([e.scores.reshape(-1) for e in group])
            if bool((scores == 0).all()):
                self.all_wrong += 1
            elif bool((scores == 1).all()):
                self.all_correct += 1
            else:
                self.other += 1

    def line(self) -> str:
        """The step line's part: ``filter kept 4 of 9 prompts (dropped 56%: 3 all wrong,
        2 all correct), 36 samples in 3 rounds``."""
        parts = [(self.all_wrong, "all wrong"), (self.all_correct, "all correct")]
        parts.append((self.other, "mean score outside the range"))
        said = ", ".join(f"{count} {name}" for count, name in parts if count)
        dropped = f" (dropped {percent(1 - self.pass_rate)}: {said})" if self.dropped else ""
        rounds = "round" if self.rounds == 1 else "rounds"
        return (
            f"filter kept {self.prompts_kept} of {self.prompts_generated} prompts{dropped}, "
            f"{self.samples_generated} samples in {self.rounds} {rounds}"
        )

    def stats(self) -> dict[str, float]:
        return {
            "rollout/filter_prompts_generated": float(self.prompts_generated),
            "rollout/filter_prompts_kept": float(self.prompts_kept),
            "rollout/filter_samples_generated": float(self.samples_generated),
            "rollout/filtered_prompt_fraction": 1 - self.pass_rate,
        }


class RefillWatch:
    """Counts the prompts generated in a row without a kept group, across rollouts, and stops
    the run at ``limit`` rollouts' worth of them (``limit`` x ``batch_size`` prompts; 0:
    never): the stop of a run without a learning signal (``signal_watch``), which a rollout of
    kept groups never reaches, counted as it would count those prompts unfiltered."""

    def __init__(self, limit: int, batch_size: int):
        self.limit, self.batch_size = limit, batch_size
        self.prompts = self.samples = 0

    def observe(self, groups: Sequence[Sequence], keeps: Sequence[bool], why: Callable[[], str]):
        """Count a round; raise ``NoLearningSignalError`` (``why``: the round's diagnosis)
        once the row reaches the limit."""
        if any(keeps):
            self.prompts = self.samples = 0
            return
        self.prompts += len(groups)
        self.samples += sum(map(len, groups))
        if self.limit and self.prompts >= self.limit * self.batch_size:
            raise NoLearningSignalError(
                f"dynamic filtering kept no prompt group in {self.prompts} prompts in a row "
                f"({self.samples} samples; {self.limit} rollouts' worth of "
                f"{self.batch_size} prompts, {WITHOUT_SIGNAL_FLAG} {self.limit}; 0 turns this "
                f"stop off): in the last round {why()}"
            )


def fill_rollout(
    generate: Callable[[int], tuple[list, int, bool]],
    target: int,
    rule: GroupFilter,
    watch: RefillWatch,
) -> tuple[list, FilterReport, bool]:
    """Kept responses of up to ``target`` prompt groups, what it took, and whether the data
    ran out. ``generate(count)`` is OpenRLHF's unfiltered generation of ``count`` new prompts:
    their single-response experiences (a prompt's ``n`` consecutive), the prompts it took and
    whether the dataloader is exhausted."""
    kept: list = []
    report = FilterReport()
    exhausted = False
    while report.prompts_kept < target and not exhausted:
        experiences, consumed, exhausted = generate(target - report.prompts_kept)
        if not consumed:
            break
        n = rule.n
        if len(experiences) != consumed * n:
            raise RuntimeError(
                f"dynamic filtering: {consumed} prompts gave {len(experiences)} responses, not "
                f"{n} each"
            )
        groups = [experiences[i : i + n] for i in range(0, len(experiences), n)]
        keeps = rule.keeps(experiences)
        report.count(groups, keeps)
        kept += [e for group, keep in zip(groups, keeps, strict=True) if keep for e in group]
        watch.observe(groups, keeps, functools.partial(rule.diagnosis, experiences))
    return kept, report, exhausted


class FilteringSamplesGenerator:
    """Mixin of the driver's samples generator (``ray_actors.StoppableSamplesGenerator``):
    under ``--algo.dynamic_filtering_enable`` each rollout is filled by ``fill_rollout`` with
    the run's rule; ``filter_report`` says what the last one took (the step line's part), and
    the pass rate OpenRLHF logs (``dynamic_filtering_pass_rate``) is the kept share of the
    prompts generated, in percent. OpenRLHF 0.11.2 divides the responses kept by the prompts,
    ``n`` times that."""

    filter_report: FilterReport | None = None
    _refill_watch: RefillWatch | None = None

    def generate_samples(self, **generate_kwargs):
        self.filter_report = None
        samples, pass_rate, consumed, exhausted = super().generate_samples(**generate_kwargs)
        if self.filter_report is not None:
            pass_rate = 100 * self.filter_report.pass_rate
        return samples, pass_rate, consumed, exhausted

    def _generate_vllm(
        self, dataloader_iter, num_prompts: int, dynamic_filtering, **generate_kwargs
    ):
        generate = super()._generate_vllm
        if not dynamic_filtering:  # evaluation, or the flag off
            return generate(dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        args = self.args
        n = generate_kwargs.get("n_samples_per_prompt", args.rollout.n_samples_per_prompt)
        rule = GroupFilter(
            None if args.drpo_run.method else args.drpo,
            tuple(args.algo.dynamic_filtering_range),
            n,
        )
        if self._refill_watch is None:
            limit = args.drpo_run.max_steps_without_signal
            self._refill_watch = RefillWatch(limit, args.rollout.batch_size)
        kept, report, exhausted = fill_rollout(
            lambda count: generate(dataloader_iter, count, False, **generate_kwargs),
            num_prompts,
            rule,
            self._refill_watch,
        )
        self.filter_report = report
        if exhausted and report.prompts_kept < num_prompts:
            print(
                f"drpo_openrlhf: dynamic filtering: the prompt data ran out with "
                f"{report.prompts_kept} of {num_prompts} groups for this rollout "
                f"({report.line()})",
                flush=True,
            )
        return kept, report.prompts_generated, exhausted
