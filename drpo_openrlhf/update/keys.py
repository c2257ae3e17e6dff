"""What the driver writes into each response's ``experience.info`` and the actor reads back.

Both sides of the update share these, the driver's experience maker (``experience``) and
the signal watch as much as the actor's trainer (``actor_trainer``), so they live here: the
driver side never imports the actor's trainer (and OpenRLHF's actor with it).
"""

from __future__ import annotations

from torch import Tensor

GROUP_KEY = "drpo_group"  # experience.info key carrying each response's prompt-group id
SLOT_KEY = "drpo_slot"  # its global micro-step in the rollout (``layout.deal_rollout``)


def correctness(scores: Tensor) -> Tensor:
    """The reward function's ``scores`` as booleans; anything but 0/1 is a configuration error."""
    bad = ~((scores == 0) | (scores == 1))
    if bad.any():
        value = scores[bad][0].item()
        raise ValueError(
            f"DRPO needs 0/1 correctness in the reward function's 'scores', got {value}; "
            "use a verifier reward (e.g. drpo_openrlhf/rewards/math_reward.py)"
        )
    return scores == 1
