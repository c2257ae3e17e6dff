"""DRPO's update inside OpenRLHF's actor: the trainer that replaces the PPO loss, the layout of
a rollout into optimizer steps and micro-batches, the driver's experience dealing and reward
shaping, the chunked log-probs, and the step line of a run without learning signal.

May import ``algo`` and ``rewards``; never ``sync`` or ``runtime`` (checked by ``make lint``).
``actor_trainer``, ``chunked_actor``, ``experience`` and ``shaping`` import OpenRLHF at module
level; ``keys``, ``layout``, ``chunked_logprobs`` and ``signal_watch`` do not. This file imports
no submodule, so ``import drpo_openrlhf.update`` alone loads no OpenRLHF.
"""
