"""A Ray actor that fails to start (issue 34, finding 7): its own error is read out of Ray's
report for the run's last line, and actor rank 0 waits for the engines before it opens the
weight-sync group. The real pipeline's case is ``tests/test_faults.py``."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import ray
from ray.exceptions import RayActorError

from drpo_openrlhf.runtime import cpu_support
from drpo_openrlhf.runtime.checkpoints import stop_message
from drpo_openrlhf.sync import engine_start

# str() of the ActorDiedError Ray 2.55 raises for a call on an actor whose __init__ raised
RAY_REPORT = (
    "The actor died because of an error raised in its creation task, "
    "\x1b[36mray::_CPURolloutRayActor.__init__()\x1b[39m (pid=10745, ip=192.0.2.2, "
    "actor_id=163674e8479ce241de2db48601000000)\n"
    '  File "site-packages/vllm/platforms/cpu.py", line 1, in check_and_update_config\n'
    "    raise ValueError(...)\n"
    "ValueError: current platform cpu does not support ray\n"
)


def test_the_actors_own_error_is_the_last_line_of_rays_report():
    error = RuntimeError(RAY_REPORT)
    assert engine_start.creation_error(error) == (
        "ValueError: current platform cpu does not support ray"
    )
    assert engine_start.start_failure(error) == (
        "a vLLM engine failed to start: ValueError: current platform cpu does not support ray"
    )
    actor = RuntimeError(RAY_REPORT.replace("_CPURolloutRayActor", "_DRPOPolicyModelActor"))
    assert engine_start.start_failure(actor).startswith("the Ray actor _DRPOPolicyModelActor")
    killed = RuntimeError("The actor died unexpectedly before finishing this task.")
    assert engine_start.creation_error(killed) is None


def test_a_failed_start_is_the_stop_line(tmp_path):
    line = stop_message(RuntimeError(RAY_REPORT), str(tmp_path))
    assert line.startswith(
        "the run stopped: a vLLM engine failed to start: ValueError: current platform cpu "
        "does not support ray."
    ), line


def test_an_actor_that_waited_for_a_failed_engine_names_the_engine(tmp_path):
    """The driver's trainer waits for the engines before its first call to them: its failed
    start reads as the engine's, not as the trainer's."""
    waited = RAY_REPORT.replace("_CPURolloutRayActor", "_GroupAwarePPOTrainer").replace(
        "ValueError: current platform cpu does not support ray",
        "drpo_openrlhf.sync.engine_start.EngineStartError: vLLM engine 0 of 2 failed "
        "to start: ValueError: injected",
    )
    line = stop_message(RuntimeError(waited), str(tmp_path))
    assert line.startswith(
        "the run stopped: EngineStartError: vLLM engine 0 of 2 failed to start: ValueError: "
        "injected."
    ), line


def test_rank_0_waits_for_the_engines_before_the_sync_group(monkeypatch):
    from openrlhf.trainer.ray import ppo_actor

    calls = []
    trainer = ppo_actor.ActorPPOTrainer

    @functools.wraps(trainer._init_vllm_sync_group)  # upstream's signature: apply checks it
    def opened(self, backend):
        calls.append("open")

    monkeypatch.setattr(trainer, "_init_vllm_sync_group", opened)
    monkeypatch.setattr(engine_start, "wait_for_engines", lambda e: calls.append(("wait", e)))
    engine_start.install()
    engine_start.install()  # once per process, however often the actor starts
    fake = type("Trainer", (), {"vllm_engines": ["e0", "e1"]})()
    trainer._init_vllm_sync_group(fake, "gloo")
    assert calls == [("wait", ["e0", "e1"]), "open"]


class FakeEngine:
    """An engine whose start ``outcome`` is "up", "failed" or "hangs"; its ready-call's
    object ref is the engine itself (``ray.wait``/``ray.get`` are faked below)."""

    def __init__(self, outcome: str):
        self.outcome = outcome
        self.get_num_unfinished_requests = SimpleNamespace(remote=lambda: self)


class FailedStart(RayActorError):
    def __init__(self):
        pass

    def __str__(self):
        return RAY_REPORT


def fake_ray(monkeypatch):
    def wait(refs, num_returns, timeout):
        started = [r for r in refs if r.outcome != "hangs"]
        return started[:num_returns], [r for r in refs if r not in started[:num_returns]]

    def get(ref):
        if ref.outcome == "failed":
            raise FailedStart
        return 0

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)


def test_the_first_engine_that_failed_stops_the_wait_and_a_hang_has_a_bound(monkeypatch):
    fake_ray(monkeypatch)
    engine_start.wait_for_engines([FakeEngine("up"), FakeEngine("up")])
    with pytest.raises(engine_start.EngineStartError) as failed:
        engine_start.wait_for_engines([FakeEngine("hangs"), FakeEngine("up"), FakeEngine("failed")])
    assert str(failed.value) == (
        "vLLM engine 2 of 3 failed to start: ValueError: current platform cpu does not support ray"
    )
    with pytest.raises(engine_start.EngineStartError, match=r"engine\(s\) \[0\] of 2 did not"):
        engine_start.wait_for_engines([FakeEngine("hangs"), FakeEngine("up")], timeout_s=0.01)


def test_vllm_tensor_parallel_is_refused_on_cpu():
    cpu_support.check_layout(2, 1, 1, 1)
    with pytest.raises(ValueError, match=r"--vllm\.tensor_parallel_size > 1"):
        cpu_support.check_layout(2, 1, 1, 2)


def test_the_trainer_waits_for_the_engines_when_it_fits_not_when_it_is_built(monkeypatch):
    """OpenRLHF's driver starts the actors' models only once the trainer is constructed: a
    wait for the engines there ran their start and DeepSpeed's set-up one after the other. The
    trainer now waits (a failed engine named first), then tags and configures the engines, at
    the start of ``fit``, before OpenRLHF's first look at the checkpoint."""
    from drpo_openrlhf.runtime import ray_actors

    calls: list[str] = []
    for name in ("tag_engines", "bind_answer_format", "configure_positive_reward", "tag_version"):
        monkeypatch.setattr(ray_actors, name, lambda *args, _name=name: calls.append(_name))
    monkeypatch.setattr(engine_start, "wait_for_engines", lambda engines: calls.append("wait"))

    class Upstream:
        def init_checkpoint_states(self) -> dict:
            calls.append("upstream")
            return {"global_step": 0}

    class Trainer(ray_actors.TrainerHooks, Upstream):
        pass

    trainer = Trainer()
    run = SimpleNamespace(
        max_logprob_gap=None, verify_weight_sync=True, max_steps_without_signal=3, method=None
    )
    trainer.args = SimpleNamespace(
        drpo_run=run, ckpt=SimpleNamespace(path="unused"), ds=SimpleNamespace(param_dtype="bf16")
    )
    trainer.vllm_engines = ["engine 0"]
    trainer.experience_maker = type("ExperienceMaker", (), {})()
    trainer._install_trainer_hooks()
    assert calls == []  # nothing waits on the engines while the actors have not started
    trainer.init_checkpoint_states()
    assert calls == [
        "wait",
        "tag_engines",
        "bind_answer_format",
        "configure_positive_reward",
        "upstream",
        "tag_version",
    ]
