"""Run OpenRLHF's own PPO entry point with DRPO's Ray actors in place of PPO's.

Imported only when a run starts: it pulls in OpenRLHF's GPU-side modules (vLLM).
"""

from __future__ import annotations

import runpy
import sys
from dataclasses import asdict
from types import SimpleNamespace

from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.openrlhf_cli import TRAIN_MODULE


def run_openrlhf(openrlhf_argv: list[str], config: DRPOConfig, run: SimpleNamespace) -> None:
    """``python -m openrlhf.cli.train_ppo_ray <openrlhf_argv>`` with DRPO's update, or, when
    ``run.method`` names a baseline, with PPO on shaped rewards; ``run.max_steps`` ends it.

    OpenRLHF's ``__main__`` looks up ``PolicyModelActor``, ``PPOTrainer`` and ``hierarchize``
    at run time, so replacing the module attributes before ``runpy`` runs it is enough: its
    own parsing, validation, placement groups, vLLM engines, checkpoints and logging stay
    untouched. ``args.drpo`` and ``args.drpo_run`` travel to every Ray actor inside
    ``strategy.args``.
    """
    import openrlhf.utils.config as openrlhf_config
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import ppo_actor

    from drpo_openrlhf.integration.ray_actors import DRPOPolicyModelActor, GroupAwarePPOTrainer

    hierarchize = openrlhf_config.hierarchize

    def hierarchize_with_drpo(args):
        nested = hierarchize(args)
        nested.drpo = SimpleNamespace(**asdict(config))
        nested.drpo_run = run
        return nested

    openrlhf_config.hierarchize = hierarchize_with_drpo
    if not run.method:
        ppo_actor.PolicyModelActor = DRPOPolicyModelActor
    ppo_trainer.PPOTrainer = GroupAwarePPOTrainer
    sys.argv = [TRAIN_MODULE, *openrlhf_argv]
    runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)
