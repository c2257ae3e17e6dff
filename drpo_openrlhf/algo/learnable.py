"""Which prompt groups an update can learn from.

DRPO's objective gives a prompt group a term only when it holds correct and incorrect
responses, unless an option keeps the all-wrong (``keep_all_wrong``) or the all-correct
(``all_correct_length_signal``) groups; every other group contributes 0 and moves nothing.
``drpo_objective`` selects its groups with ``group_has_signal``, so the trainer's account of a
rollout (``learnable_groups``) is the objective's own rule, not a copy of it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from drpo_openrlhf.algo.config import DRPOConfig
from drpo_openrlhf.algo.groups import dense_group_index, segment_sum


def group_outcomes(correct: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Per group (in sorted id order): whether it holds a correct and an incorrect response."""
    index, num_groups = dense_group_index(group_ids)
    n_pos = segment_sum(correct.bool().double(), index, num_groups)
    return n_pos > 0, segment_sum((~correct.bool()).double(), index, num_groups) > 0


def group_has_signal(
    has_pos: Tensor,
    has_neg: Tensor,
    *,
    keep_all_wrong: bool = False,
    all_correct_length_signal: bool = False,
) -> Tensor:
    """The groups that get a term in DRPO's objective: mixed ones, plus all-wrong ones under
    ``keep_all_wrong`` and all-correct ones under ``all_correct_length_signal``."""
    selected = has_pos & has_neg
    if keep_all_wrong:
        selected = selected | (~has_pos & has_neg)
    if all_correct_length_signal:
        selected = selected | (has_pos & ~has_neg)
    return selected


def learnable_groups(correct: Tensor, group_ids: Tensor, config: DRPOConfig) -> Tensor:
    """Per group (sorted id order): whether DRPO's update under ``config`` learns from it.

    An all-correct group's length signal ranks its correct responses among themselves; with
    ``lam = inf`` (DisCO) every weight is equal and that term is 0 for every group, so it is
    not counted then. (Correct responses of equal length give such a group no signal either:
    a tie this rule does not look for.)
    """
    has_pos, has_neg = group_outcomes(correct, group_ids)
    return group_has_signal(
        has_pos,
        has_neg,
        keep_all_wrong=config.keep_all_wrong,
        all_correct_length_signal=config.all_correct_length_signal and math.isfinite(config.lam),
    )


def unlearnable_counts(correct: Tensor, group_ids: Tensor) -> tuple[int, int]:
    """How many groups are all correct and how many all wrong: the two ways a group can fail
    to be mixed, which call for different fixes."""
    has_pos, has_neg = group_outcomes(correct, group_ids)
    return int(torch.sum(has_pos & ~has_neg)), int(torch.sum(~has_pos & has_neg))
