"""The Ray actor classes a DRPO run uses in place of OpenRLHF's.

Ray forbids subclassing a ``@ray.remote`` class, so we subclass the undecorated classes and
decorate ours. They live in an importable module: Ray pickles them by reference, so every
node must be able to ``import drpo_openrlhf`` (same environment, or a ``runtime_env``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict

import ray
from openrlhf.trainer import ppo_trainer
from openrlhf.trainer.ray import ppo_actor

from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.integration.actor_trainer import DRPOActorTrainer
from drpo_openrlhf.integration.experience import GroupTaggingExperienceMaker

logger = logging.getLogger(__name__)
CHECKPOINT_KEY = "drpo"


class _DRPOPolicyModelActor(ppo_actor.PolicyModelActor.__ray_actor_class__):
    def init_model_from_pretrained(self, strategy, *args, **kwargs):
        super().init_model_from_pretrained(strategy, *args, **kwargs)
        config = DRPOConfig(**vars(strategy.args.drpo))
        # Swap the class rather than building a second trainer: the constructor opened the
        # vLLM weight-sync group, which must exist exactly once.
        self.trainer.__class__ = DRPOActorTrainer
        self.trainer.enable_drpo(config)
        saved = self.checkpoint_states.get(CHECKPOINT_KEY)
        if saved is not None and saved != asdict(config):
            logger.warning(
                "resuming with DRPO settings %s; checkpoint had %s", asdict(config), saved
            )

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        states = dict(client_states or {})
        states[CHECKPOINT_KEY] = asdict(self.trainer.drpo)
        return super().save_checkpoint(tag, states, metric_value, metric_key)


class _DRPOPPOTrainer(ppo_trainer.PPOTrainer.__ray_actor_class__):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.experience_maker.__class__ = GroupTaggingExperienceMaker


DRPOPolicyModelActor = ray.remote(num_gpus=1)(_DRPOPolicyModelActor)
DRPOPPOTrainer = ray.remote(_DRPOPPOTrainer)
