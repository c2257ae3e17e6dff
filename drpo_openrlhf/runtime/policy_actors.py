"""The policy actor classes a DRPO (or baseline) run uses in place of OpenRLHF's
``PolicyModelActor``: DRPO's update (or PPO's for a baseline), checked weight syncs,
chunked log-probs, complete checkpoints that carry the run's DRPO settings.

Ray forbids subclassing a ``@ray.remote`` class, so we subclass the undecorated class and
decorate ours. Ray pickles them by reference, so an actor's process imports this module and
what it imports: the actor's side (DeepSpeed, OpenRLHF's ``ppo_actor``), not the driver's
trainer (``ray_actors``) nor its datasets.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

import ray
from openrlhf.trainer.ray import ppo_actor

from drpo_openrlhf import upstream
from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.runtime.build_lock import BuildLockWatch
from drpo_openrlhf.runtime.checkpoints import CompleteCheckpointActor
from drpo_openrlhf.sync import engine_start
from drpo_openrlhf.sync.sync_check import SentDigestsActor
from drpo_openrlhf.update import chunked_actor
from drpo_openrlhf.update.actor_trainer import DRPOActorTrainer, FiniteCheckedPPOTrainer

logger = logging.getLogger(__name__)
DRPO_STATE = "drpo"  # our key in OpenRLHF's checkpoint client state: the run's DRPOConfig


def warn_if_settings_changed(saved: dict | None, config: DRPOConfig) -> None:
    """Warn when a run resumes with other DRPO settings than its checkpoint saved (None: a
    fresh start), naming each one that changed: a resume may change the loss, not silently."""
    current = asdict(config)
    if saved is None or saved == current:
        return
    changed = sorted(
        k
        for k in saved.keys() | current.keys()
        if k not in saved or k not in current or saved[k] != current[k]
    )
    logger.warning(
        "resuming with different DRPO settings: %s",
        ", ".join(f"{k}: {_setting(saved, k)} -> {_setting(current, k)}" for k in changed),
    )


def _setting(settings: dict, key: str) -> str:
    return repr(settings[key]) if key in settings else "(absent)"


class _BaselinePolicyModelActor(
    CompleteCheckpointActor, SentDigestsActor, ppo_actor.PolicyModelActor.__ray_actor_class__
):
    """OpenRLHF's actor (baselines' PPO update) whose weight syncs are checked and whose
    log-probs are computed in chunks, as DRPO's."""

    def init_model_from_pretrained(self, strategy, *args, **kwargs):
        engine_start.install()
        with BuildLockWatch():  # DeepSpeed builds its ops here
            super().init_model_from_pretrained(strategy, *args, **kwargs)
        chunked_actor.install(self.actor, strategy.args.drpo_run.logprob_chunk_tokens)
        upstream.swap_class(self.trainer, FiniteCheckedPPOTrainer)


class _DRPOPolicyModelActor(
    CompleteCheckpointActor, SentDigestsActor, ppo_actor.PolicyModelActor.__ray_actor_class__
):
    def init_model_from_pretrained(self, strategy, *args, **kwargs):
        engine_start.install()
        with BuildLockWatch():  # DeepSpeed builds its ops here
            super().init_model_from_pretrained(strategy, *args, **kwargs)
        # strategy.args is OpenRLHF's nested args, to which launch.run_openrlhf's wrapper of
        # its hierarchize adds drpo_run (the run's options) and drpo (its DRPOConfig)
        chunked_actor.install(self.actor, strategy.args.drpo_run.logprob_chunk_tokens)
        self._enable_drpo(strategy.args.drpo)

    def _enable_drpo(self, config: DRPOConfig) -> None:
        """DRPO's loss on the trainer OpenRLHF built, with a warning when a resume changes the
        checkpoint's DRPO settings. The class is swapped rather than a second trainer built:
        the constructor opened the vLLM weight-sync group, which must exist exactly once."""
        upstream.swap_class(self.trainer, DRPOActorTrainer)
        self.trainer.enable_drpo(config)
        warn_if_settings_changed(self.checkpoint_states.get(DRPO_STATE), config)

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        states = {**(client_states or {}), DRPO_STATE: asdict(self.trainer.drpo)}
        return super().save_checkpoint(tag, states, metric_value, metric_key)


# OpenRLHF's train() (cli/train_ppo_ray.py) creates it through the name PolicyModelActor,
# which launch.run_openrlhf's "driver" site of upstream.TABLE points at.
DRPOPolicyModelActor = ray.remote(num_gpus=1)(_DRPOPolicyModelActor)
BaselinePolicyModelActor = ray.remote(num_gpus=1)(_BaselinePolicyModelActor)
