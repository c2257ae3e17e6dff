"""How far the rollout engine's token log-probs are from the trainer's on the same weights.

After a weight sync vLLM and the actor hold the same policy, so the log-probs vLLM reported
while sampling should equal the actor's own up to numerical precision. A large gap means the
sync did not happen (an engine still sampling from old or uninitialised weights) or a
precision mismatch, both of which bias every update silently.
"""

from __future__ import annotations

import torch


def logprob_gap(
    rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor, action_mask: torch.Tensor
) -> tuple[float, float, int]:
    """``(mean, max, count)`` of ``|rollout - actor|`` over the action tokens of a batch
    (``(B, A)`` tensors). ``count`` lets batches be pooled; an empty mask gives ``(0, 0, 0)``."""
    if rollout_log_probs.shape != actor_log_probs.shape:
        raise ValueError(
            f"rollout log-probs {tuple(rollout_log_probs.shape)} and actor log-probs "
            f"{tuple(actor_log_probs.shape)} differ in shape"
        )
    mask = action_mask.bool()
    gap = (rollout_log_probs.double() - actor_log_probs.double()).abs()[mask]
    if gap.numel() == 0:
        return 0.0, 0.0, 0
    return gap.mean().item(), gap.max().item(), gap.numel()


def pooled_gap(parts: list[tuple[float, float, int]]) -> tuple[float, float]:
    """Mean and max of the gap over several batches' ``logprob_gap`` results."""
    count = sum(n for _, _, n in parts)
    if count == 0:
        return 0.0, 0.0
    return sum(m * n for m, _, n in parts) / count, max(x for _, x, _ in parts)
