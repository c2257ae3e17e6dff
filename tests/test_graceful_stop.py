"""The graceful stop (``integration/graceful_stop.py``) in the trainer, without Ray: a trainer
built by hand runs OpenRLHF's own ``save_logs_and_checkpoints`` against a stand-in actor group
that records each ``save_checkpoint``. The launcher's side is in tests/test_slurm_recipes.py,
the entry point's in tests/test_train_cli.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from openrlhf.trainer import ppo_trainer
from openrlhf.utils.config import hierarchize

from drpo_openrlhf.integration import ray_actors
from drpo_openrlhf.integration.graceful_stop import (
    STOP_FILE,
    StopRequested,
    clear_stale_request,
)
from drpo_openrlhf.openrlhf_cli import openrlhf_parser

OPENRLHF_TRAINER = ppo_trainer.PPOTrainer.__ray_actor_class__  # the class our trainer extends
SAVE_STEPS = 5


class RecordingActorGroup:
    """The actor group's ``save_checkpoint`` calls, recorded instead of run."""

    def __init__(self) -> None:
        self.saved: list[tuple[str, dict]] = []

    def async_run_method(self, method_name: str, tag: str, client_states: dict, **kwargs):
        assert method_name == "save_checkpoint"
        self.saved.append((tag, dict(client_states)))
        return []


class Tracker:
    """A logger that records what OpenRLHF and the trainer do with it."""

    def __init__(self) -> None:
        self.writer = SimpleNamespace(flush=lambda: None)
        self.logged: list[int] = []
        self.closed = False

    def log_train(self, step: int, logs: dict) -> None:
        self.logged.append(step)

    def close(self) -> None:
        self.closed = True


def trainer(ckpt: Path) -> ray_actors._GroupAwarePPOTrainer:
    args = hierarchize(
        openrlhf_parser().parse_args(
            ["--ckpt.path", str(ckpt), "--ckpt.save_steps", str(SAVE_STEPS)]
        )
    )
    args.drpo_run = SimpleNamespace(max_steps=None)
    t = ray_actors._GroupAwarePPOTrainer.__new__(ray_actors._GroupAwarePPOTrainer)
    t.args, t.experience_maker = args, SimpleNamespace()  # no shaper: a DRPO run
    t.actor_model_group, t.critic_model_group = RecordingActorGroup(), None
    t.wandb_logger, t.tensorboard_logger = None, Tracker()
    t.best_eval_metric_key = t.best_eval_metric_value = t._latest_eval_metric_value = None
    return t


@pytest.fixture
def steps(monkeypatch):
    """OpenRLHF's ``fit`` reduced to its per-step call, for 12 steps; ``request_at`` holds the
    steps before whose save the request file appears."""
    request_at: set[int] = set()
    monkeypatch.setattr(ppo_trainer, "ray", SimpleNamespace(get=lambda refs: refs))

    def fit(self, global_step=0):
        for step in range(1, 13):
            if step in request_at:
                (Path(self.args.ckpt.path) / STOP_FILE).touch()
            self.save_logs_and_checkpoints(step, {}, {"global_step": step})

    monkeypatch.setattr(OPENRLHF_TRAINER, "fit", fit)
    return request_at


def saved_tags(t) -> list[str]:
    return [tag for tag, _ in t.actor_model_group.saved]


def test_a_stop_request_saves_that_step_through_openrlhf_and_ends_the_run(tmp_path, steps):
    t = trainer(tmp_path)
    steps.add(3)
    with pytest.raises(StopRequested, match=r"^stop requested: saved global_step3, stopping$"):
        t.fit()
    assert saved_tags(t) == ["global_step3"]
    ((_, states),) = t.actor_model_group.saved
    # OpenRLHF's own save code ran: it adds its eval-metric states to ours
    assert states["global_step"] == 3 and "best_eval_metric_key" in states
    assert t.tensorboard_logger.logged == [1, 2, 3] and t.tensorboard_logger.closed
    assert t.args.ckpt.save_steps == SAVE_STEPS  # the regular period is back


def test_a_request_at_a_regular_save_step_saves_it_once(tmp_path, steps):
    t = trainer(tmp_path)
    steps.add(10)
    with pytest.raises(StopRequested, match="saved global_step10,"):
        t.fit()
    assert saved_tags(t) == ["global_step5", "global_step10"]


def test_without_a_request_only_the_regular_steps_are_saved(tmp_path, steps):
    t = trainer(tmp_path)
    t.fit()
    assert saved_tags(t) == ["global_step5", "global_step10"]
    assert t.tensorboard_logger.logged == list(range(1, 13))


def test_a_stale_request_is_removed_and_said(tmp_path):
    assert clear_stale_request(str(tmp_path)) is None
    (tmp_path / STOP_FILE).touch()
    message = clear_stale_request(str(tmp_path))
    assert message == f"removed the stop request {tmp_path / STOP_FILE} left by an earlier run"
    assert not (tmp_path / STOP_FILE).exists()
