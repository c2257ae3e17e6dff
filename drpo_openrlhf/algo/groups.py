"""Segment operations over prompt groups.

A batch holds the responses of several prompts in any order; ``group_ids`` names each
response's prompt. Every per-prompt quantity of DRPO is a segment reduction over these ids,
so the math never depends on how responses were laid out or shuffled.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dense_group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary prompt ids to ``0..G-1`` (in sorted id order) and return ``G``."""
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
    unique, index = torch.unique(group_ids, return_inverse=True)
    return index, unique.numel()


def count_distinct(ids: Tensor) -> int:
    """How many distinct values ``ids`` holds (prompt groups, micro-steps)."""
    return int(torch.unique(ids).numel())


def segment_sum(values: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """Differentiable per-group sum."""
    return values.new_zeros(num_groups).index_add(0, index, values)


def segment_logsumexp(values: Tensor, index: Tensor, num_groups: int, mask: Tensor) -> Tensor:
    """Per-group ``log sum exp`` over the entries where ``mask`` is true.

    Stable for large magnitudes (shifted by the group max) and NaN-free in the backward pass,
    including for groups with no entry, whose value is ``-inf``.
    """
    masked = torch.where(mask, values, float("-inf"))
    group_max = values.new_full((num_groups,), float("-inf"))
    group_max = group_max.scatter_reduce(0, index, masked.detach(), "amax", include_self=True)
    # The inner where keeps an unmasked entry's value out of exp (its overflow, or an empty
    # group's -inf shift, would turn its zero gradient into NaN, as would the NaN that an
    # empty group's log(0) sends back); the outer one keeps it out of the sum. An empty
    # group's value is log(0) + (-inf) = -inf.
    exp = torch.where(mask, torch.exp(torch.where(mask, values - group_max[index], 0.0)), 0.0)
    return torch.log(segment_sum(exp, index, num_groups)) + group_max
