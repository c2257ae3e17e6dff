"""Per-response scalars computed from token log-probs.

DRPO's objective depends on a response only through its score ``s(o, q)`` (the mean token
log-prob), its token count and its summed KL; these are the only numbers that ever need to
cross micro-batch or rank boundaries.
"""

from __future__ import annotations

from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum over the last dimension of the entries where ``mask`` is set."""
    return (values * mask).sum(dim=-1)


def sequence_scores(log_probs: Tensor, mask: Tensor) -> Tensor:
    """``s(o, q) = (1/|o|) sum_t log pi(o_t | q, o_<t)`` over the response mask, shape (B,)."""
    num_tokens = mask.sum(dim=-1)
    if (num_tokens == 0).any():
        raise ValueError("every response needs at least one token in its mask")
    return masked_sum(log_probs, mask) / num_tokens.to(log_probs.dtype)


def kl_sums(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """Per-response ``sum_t log pi_old - log pi_theta``: the summands of the token-mean KL."""
    return masked_sum(old_log_probs - log_probs, mask)
