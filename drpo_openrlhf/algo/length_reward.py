"""Length rewards ``r_l(o)`` for correct responses (paper Section 3.2 and Appendix)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

LENGTH_REWARDS = ("linear", "concave", "cosine")


def length_reward(
    lengths: Tensor | Sequence[float], max_len: float, kind: str = "linear"
) -> Tensor:
    """``r_l`` of responses with ``lengths`` tokens for a budget ``C = max_len``.

    ``linear``: ``1 - L/C`` (the paper's main choice), ``concave``: ``1 - (L/C)^2``,
    ``cosine``: ``0.5 + 0.5 cos(pi L / C)``. All map ``[0, C]`` onto ``[0, 1]``, decreasing.
    ``L/C`` is clipped at 1: a C smaller than the generation budget gives every response
    longer than C the minimum reward instead of values outside ``[0, 1]`` (and, for cosine,
    a reward that would rise again).
    """
    if kind not in LENGTH_REWARDS:
        raise ValueError(f"unknown length reward {kind!r}; choose one of {LENGTH_REWARDS}")
    if not max_len > 0:
        raise ValueError(f"max_len (C) must be positive, got {max_len}")
    lengths = torch.as_tensor(lengths)
    if not lengths.is_floating_point():
        lengths = lengths.to(torch.get_default_dtype())
    if (lengths < 0).any():
        raise ValueError("response lengths must be non-negative")
    ratio = (lengths / max_len).clamp(max=1.0)
    if kind == "linear":
        return 1.0 - ratio
    if kind == "concave":
        return 1.0 - ratio.square()
    return 0.5 + 0.5 * torch.cos(math.pi * ratio)
