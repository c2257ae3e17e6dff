"""Save -> stop -> resume of the DRPO actor continues exactly like an uninterrupted run, and
the checkpoint carries the DRPO settings."""

import logging
import math
from dataclasses import asdict

import pytest
import torch
from drpo_actor_harness import Case, drpo_config, openrlhf_args, rollout, tiny_model

from drpo_openrlhf.algo import DRPOConfig
from drpo_openrlhf.testing import free_port, spawn_ranks

# the spawned worker imports this module without conftest: OpenRLHF is imported lazily

CASE = Case(zero_stage=2, micro_batch_size=4)


def fresh_trainer(ckpt_dir: str):
    from drpo_openrlhf import testing
    from drpo_openrlhf.update.actor_trainer import DRPOActorTrainer

    args = openrlhf_args(CASE, 1)
    args.ckpt.path = ckpt_dir
    strategy = testing.setup_strategy(args, "fp32")
    actor, optim, scheduler = testing.prepare_actor(strategy, tiny_model())
    trainer = testing.ppo_trainer(strategy, actor, optim, scheduler)
    trainer.__class__ = DRPOActorTrainer
    trainer.enable_drpo(drpo_config(CASE))
    return strategy, actor, trainer


def train_rollout(actor, trainer, seed: int) -> None:
    """One rollout whose old log-probs come from the current policy, as in OpenRLHF."""
    from drpo_openrlhf import testing

    data = rollout(seed)
    with torch.no_grad():
        old = actor(data["sequences"], data["action_mask"], attention_mask=data["attention_mask"])
    _, info = testing.dealt_share(data["group"], trainer.drpo_layout)
    trainer.replay_buffer.append(testing.experience(data, old, info))
    with testing.cuda_queries_answered("cpu", "cpu"):
        trainer.ppo_train(0.0)
    trainer.replay_buffer.clear()


def weights(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor.model.module.parameters()]


def resume_worker(rank: int, port: int, ckpt_dir: str, out: str) -> None:
    from drpo_openrlhf import testing

    testing.set_rank_env(rank, 1, port)
    from drpo_openrlhf.runtime import policy_actors

    # uninterrupted: two rollouts (with an EMA model, whose update is recorded, not run)
    strategy, actor, trainer = fresh_trainer(ckpt_dir)
    ema_calls = []
    trainer.ema_model = "ema"
    strategy.moving_average = lambda model, ema, beta, device: ema_calls.append(ema)
    train_rollout(actor, trainer, 0)
    train_rollout(actor, trainer, 1)
    uninterrupted = weights(actor)
    # interrupted: one rollout, checkpoint through the DRPO actor class, new engine, resume
    strategy, actor, trainer = fresh_trainer(ckpt_dir)
    train_rollout(actor, trainer, 0)
    policy = policy_actors._DRPOPolicyModelActor.__new__(policy_actors._DRPOPolicyModelActor)
    policy.strategy, policy.actor, policy.trainer = strategy, actor, trainer
    policy.disable_ds_ckpt, policy.save_hf_ckpt = False, False
    with testing.cuda_queries_answered("cpu", 0):
        policy.save_checkpoint("global_step1", {"global_step": 1})
    del actor, trainer, policy
    strategy, actor, trainer = fresh_trainer(ckpt_dir)
    _, states = strategy.load_ckpt(actor.model, f"{ckpt_dir}/_actor")
    train_rollout(actor, trainer, 1)
    torch.save(
        {
            "uninterrupted": uninterrupted,
            "resumed": weights(actor),
            "states": states,
            "ema_calls": len(ema_calls),
            "micro_steps": 2 * trainer.drpo_layout.micro_steps * 2,  # 2 rollouts x 2 steps
        },
        out,
    )


@pytest.mark.slow
def test_resume_continues_like_an_uninterrupted_run(tmp_path):
    from drpo_openrlhf.runtime import policy_actors

    out = tmp_path / "result.pt"
    spawn_ranks(resume_worker, (free_port(), str(tmp_path / "ckpt"), str(out)), 1)
    result = torch.load(out, weights_only=False)
    for a, b in zip(result["uninterrupted"], result["resumed"], strict=True):
        assert torch.equal(a, b)
    assert result["states"]["global_step"] == 1
    assert result["ema_calls"] == result["micro_steps"]  # once per micro-step, as OpenRLHF
    assert result["states"][policy_actors.DRPO_STATE] == asdict(drpo_config(CASE))
    initial = [p.detach() for p in tiny_model().parameters()]
    assert any(not torch.equal(a, i) for a, i in zip(result["resumed"], initial, strict=True))


def test_changed_settings_on_resume_are_reported(caplog, monkeypatch):
    """The DRPO actor, as it enables DRPO on OpenRLHF's trainer, warns when the checkpoint it
    resumes from saved other DRPO settings, naming each one that changed."""
    from drpo_openrlhf.runtime import policy_actors
    from drpo_openrlhf.update.actor_trainer import DRPOActorTrainer

    enabled = []
    monkeypatch.setattr(DRPOActorTrainer, "enable_drpo", lambda _, config: enabled.append(config))
    policy = policy_actors._DRPOPolicyModelActor.__new__(policy_actors._DRPOPolicyModelActor)
    policy.trainer = DRPOActorTrainer.__new__(DRPOActorTrainer)

    def resume(saved: dict | None, config: DRPOConfig) -> str:
        policy.checkpoint_states = {} if saved is None else {policy_actors.DRPO_STATE: saved}
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            policy._enable_drpo(config)
        assert enabled.pop() is config
        return caplog.text

    saved = asdict(DRPOConfig(lam=0.1))
    assert resume(saved, DRPOConfig(lam=0.1)) == ""
    assert resume(None, DRPOConfig(lam=0.2)) == ""  # a fresh start
    changed = resume(saved, DRPOConfig(lam=math.inf, tau=5.0))
    assert "lam: 0.1 -> inf" in changed and "tau: 10.0 -> 5.0" in changed
    assert "delta" not in changed
    assert "gone: 1 -> (absent)" in resume({**saved, "gone": 1}, DRPOConfig(lam=0.1))
