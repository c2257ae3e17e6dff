"""DRPO's update inside OpenRLHF's actor: the trainer that replaces the PPO loss, the layout of
a rollout into optimizer steps and micro-batches, the driver's experience dealing and reward
shaping, the chunked log-probs, and the step line of a run without learning signal.

May import ``algo`` and ``rewards``; never ``sync`` or ``runtime`` (checked by ``make lint``).
OpenRLHF is imported lazily, inside the functions that need it.
"""
