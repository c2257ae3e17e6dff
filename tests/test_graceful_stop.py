"""The graceful stop (``runtime/graceful_stop.py``) in the trainer, without Ray: a trainer
built by hand runs OpenRLHF's own ``save_logs_and_checkpoints`` against a stand-in actor group
that records each ``save_checkpoint``; the generator's cancelling runs its real watcher thread
against stand-in requests. The launcher's side is in tests/test_slurm_recipes.py (with the
real pipeline: a request during generation), the entry point's in tests/test_train_cli.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from openrlhf.trainer import ppo_trainer
from openrlhf.trainer.ppo_utils import samples_generator
from openrlhf.utils.config import hierarchize
from ray.exceptions import TaskCancelledError
from time_bounds import Deadline, assert_within

from drpo_openrlhf.runtime import ray_actors
from drpo_openrlhf.runtime.graceful_stop import (
    STEP_TIMES_FILE,
    STOP_FILE,
    RolloutCanceller,
    StepTimes,
    StopBeforeUpdate,
    StopRequested,
    clear_stale_request,
    stop_advice,
)
from drpo_openrlhf.runtime.openrlhf_cli import openrlhf_parser
from drpo_openrlhf.sync.logprob_gap import GapLimit

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
    t.samples_generator = SimpleNamespace(canceller=RolloutCanceller(str(ckpt), cancel=print))
    t._step_times, t._finished = StepTimes(str(ckpt)), None
    t._gap_limit = GapLimit(None, exact_start=True, honest=0.002, honest_step=1)
    return t


def timings(step: int) -> dict[str, float]:
    return {"timing/generation": 10.0, "timing/make_experience": 2.0, "timing/ppo_train": step}


@pytest.fixture
def steps(monkeypatch):
    """OpenRLHF's ``fit`` reduced to a step's calls, for 12 steps: generation, the update
    (``ppo_train``, ours then a stand-in for OpenRLHF's), the save. ``request_at`` holds the
    steps after whose update the request file appears; ``request_before_update`` those during
    whose generation it does."""
    request_at: set[int] = set()
    request_before_update: set[int] = set()
    monkeypatch.setattr(ppo_trainer, "ray", SimpleNamespace(get=lambda refs: refs))
    monkeypatch.setattr(OPENRLHF_TRAINER, "ppo_train", lambda self, step: {})

    def fit(self, global_step=0):
        for step in range(1, 13):
            request = Path(self.args.ckpt.path) / STOP_FILE
            if step in request_before_update:
                request.touch()
            self.ppo_train(step)
            if step in request_at:
                request.touch()
            state = {"global_step": step, "data_loader_state_dict": {"consumed": 4 * step}}
            self.save_logs_and_checkpoints(step, timings(step), state)

    monkeypatch.setattr(OPENRLHF_TRAINER, "fit", fit)
    return SimpleNamespace(after_update=request_at, before_update=request_before_update)


def saved_tags(t) -> list[str]:
    return [tag for tag, _ in t.actor_model_group.saved]


def test_a_stop_request_saves_that_step_through_openrlhf_and_ends_the_run(tmp_path, steps):
    t = trainer(tmp_path)
    steps.after_update.add(3)
    with pytest.raises(StopRequested, match=r"^stop requested: saved global_step3, stopping$"):
        t.fit()
    assert saved_tags(t) == ["global_step3"]
    ((_, states),) = t.actor_model_group.saved
    # OpenRLHF's own save code ran: it adds its eval-metric states to ours
    assert states["global_step"] == 3 and "best_eval_metric_key" in states
    assert states["logprob_gap"] == {
        "honest": 0.002,
        "step": 1,
        "param_dtype": "bf16",
    }  # the resume is held to it
    assert t.tensorboard_logger.logged == [1, 2, 3] and t.tensorboard_logger.closed
    assert t.args.ckpt.save_steps == SAVE_STEPS  # the regular period is back


def test_a_request_at_a_regular_save_step_saves_it_once(tmp_path, steps):
    t = trainer(tmp_path)
    steps.after_update.add(10)
    with pytest.raises(StopRequested, match="saved global_step10,"):
        t.fit()
    assert saved_tags(t) == ["global_step5", "global_step10"]


def test_without_a_request_only_the_regular_steps_are_saved(tmp_path, steps):
    t = trainer(tmp_path)
    t.fit()
    assert saved_tags(t) == ["global_step5", "global_step10"]
    assert t.tensorboard_logger.logged == list(range(1, 13))


def test_a_request_before_the_update_saves_the_previous_step_as_it_ended(tmp_path, steps):
    """Before step 4's update the actor holds step 3's weights: step 3's checkpoint, with the
    client states (data-loader position) step 3 ended with, not step 4's."""
    t = trainer(tmp_path)
    steps.before_update.add(4)
    with pytest.raises(StopRequested) as stop:
        t.fit()
    assert str(stop.value) == (
        "stop requested: saved global_step3, stopping (step 4 was dropped before its update; "
        "a resume generates it again)"
    )
    ((tag, states),) = t.actor_model_group.saved
    assert tag == "global_step3" and states["data_loader_state_dict"] == {"consumed": 12}
    assert "best_eval_metric_key" in states  # through OpenRLHF's own save code
    assert states["logprob_gap"] == {"honest": 0.002, "step": 1, "param_dtype": "bf16"}
    assert t.tensorboard_logger.logged == [1, 2, 3] and t.tensorboard_logger.closed
    assert t.args.ckpt.save_steps == SAVE_STEPS


def test_a_request_before_the_update_after_a_regular_save_saves_nothing_again(tmp_path, steps):
    t = trainer(tmp_path)
    steps.before_update.add(SAVE_STEPS + 1)
    with pytest.raises(StopRequested, match=rf"^stop requested: global_step{SAVE_STEPS} is saved,"):
        t.fit()
    assert saved_tags(t) == [f"global_step{SAVE_STEPS}"]


def test_a_request_before_the_first_step_finished_saves_nothing(tmp_path, steps):
    t = trainer(tmp_path)
    steps.before_update.add(1)
    with pytest.raises(StopRequested, match="before this run finished a step: nothing new"):
        t.fit()
    assert saved_tags(t) == [] and t.tensorboard_logger.closed


def test_each_step_writes_its_phase_times_and_the_longest_update_and_save(tmp_path, steps):
    t = trainer(tmp_path)
    steps.after_update.add(7)
    with pytest.raises(StopRequested):
        t.fit()
    times = json.loads((tmp_path / STEP_TIMES_FILE).read_text())
    assert times["step"] == 7
    assert times["phases_s"] == {"generation": 10.0, "make_experience": 2.0, "ppo_train": 7.0}
    assert times["longest_update_and_sync_s"] == 7.0  # ppo_train 1..7 s, no broadcast here
    assert times["longest_save_s"] is not None and times["longest_save_s"] >= 0


class Engines:
    """What the generator asks of the vLLM engines: requests (refs), their cancelling, sleep."""

    def __init__(self) -> None:
        self.cancelled: set[int] = set()
        self.calls: list[str] = []


# A request 0.3 s into a generation cancels it within the watcher's poll (0.05 s): 0.31 s in
# all measured (2 cores at load 6-7), and with a 4 s poll 4.0 s, over the bound; the 2 s of
# slack past the request are 40 polls, stretched by the time scale. The stand-in holds its
# requests past that bound (5 s at scale 1, stretched too): a cancel that never comes fails
# on the hold, saying so.
REQUEST_AFTER_S, CANCEL_SLACK_S, HOLD_S = 0.3, 2.0, 5.0


@pytest.fixture
def generator(tmp_path, monkeypatch):
    """``StoppableSamplesGenerator`` over a stand-in of OpenRLHF's generation: it sends two
    requests and waits for them as ``_generate_vllm`` does, failing with Ray's
    ``TaskCancelledError`` on a cancelled one; ``hold`` keeps them unfinished (``HOLD_S``, then
    it fails); ``late`` makes the request file appear as they finish (before the watcher's next
    look)."""
    engines, hold, late = Engines(), threading.Event(), threading.Event()

    def dispatch(self, prompts, labels, **kwargs):
        return [0, 1]

    def generate_samples(self, **kwargs):
        refs = self._dispatch_prompts_to_vllm(["p"], ["l"])
        held = Deadline(HOLD_S, "requests held unfinished and never cancelled")
        while hold.is_set() and not held.expired():
            if engines.cancelled & set(refs):
                raise TaskCancelledError()
            time.sleep(0.01)
        if hold.is_set():
            held.check()
        if late.is_set():
            (tmp_path / STOP_FILE).touch()
        return ["rollout"], None, 1, False

    monkeypatch.setattr(samples_generator.SamplesGenerator, "_dispatch_prompts_to_vllm", dispatch)
    monkeypatch.setattr(samples_generator.SamplesGenerator, "generate_samples", generate_samples)
    monkeypatch.setattr(
        ray_actors.vllm_engine,
        "batch_vllm_engine_call",
        lambda engine_list, method: engines.calls.append(method),
    )
    g = ray_actors.StoppableSamplesGenerator.__new__(ray_actors.StoppableSamplesGenerator)
    g.args = SimpleNamespace(ckpt=SimpleNamespace(path=str(tmp_path)))
    g.args.vllm = SimpleNamespace(enable_sleep=True)
    g.vllm_engines = ["engine"]
    g.canceller = RolloutCanceller(str(tmp_path), cancel=engines.cancelled.add, poll_s=0.05)
    request = tmp_path / STOP_FILE
    return SimpleNamespace(g=g, engines=engines, hold=hold, late=late, request=request)


def test_a_request_during_generation_cancels_it_within_the_poll(generator):
    generator.hold.set()
    timer = threading.Timer(REQUEST_AFTER_S, generator.request.touch)
    timer.start()
    started = time.monotonic()
    with pytest.raises(StopBeforeUpdate):
        generator.g.generate_samples()
    elapsed = time.monotonic() - started
    assert_within(elapsed, CANCEL_SLACK_S, "a request's cancel", fixed_s=REQUEST_AFTER_S)
    assert generator.engines.cancelled == {0, 1}
    assert generator.engines.calls == ["sleep"]  # as after any generation (sleep mode)


def test_without_a_request_a_generation_runs_to_its_end(generator):
    assert generator.g.generate_samples() == (["rollout"], None, 1, False)
    assert generator.engines.cancelled == set() and generator.engines.calls == []


def test_a_request_before_or_after_a_generation_drops_its_rollout(generator):
    generator.request.touch()  # before: nothing is sent
    with pytest.raises(StopBeforeUpdate):
        generator.g.generate_samples()
    generator.request.unlink()
    generator.late.set()  # after: the rollout is complete, the update has not begun
    with pytest.raises(StopBeforeUpdate):
        generator.g.generate_samples()
    assert generator.engines.cancelled == set() and generator.engines.calls == []


def test_a_cancelled_request_without_a_stop_request_is_an_error(generator):
    generator.hold.set()
    threading.Timer(0.2, lambda: generator.engines.cancelled.add(0)).start()
    with pytest.raises(TaskCancelledError):
        generator.g.generate_samples()
    assert generator.engines.calls == []


def test_a_stale_request_is_removed_and_said(tmp_path):
    assert clear_stale_request(str(tmp_path)) is None
    (tmp_path / STOP_FILE).touch()
    message = clear_stale_request(str(tmp_path))
    assert message == f"removed the stop request {tmp_path / STOP_FILE} left by an earlier run"
    assert not (tmp_path / STOP_FILE).exists()


def test_the_stop_advice_sizes_the_grace_from_the_measured_times(tmp_path):
    assert stop_advice(str(tmp_path), 240).startswith("no step has finished yet")
    times = {"step": 3, "phases_s": {"generation": 400.0, "ppo_train": 100.0}}
    record = tmp_path / STEP_TIMES_FILE
    record.write_text(
        json.dumps({**times, "longest_update_and_sync_s": 110.0, "longest_save_s": None})
    )
    assert stop_advice(str(tmp_path), 240) == (
        "step 3: generation 400s, ppo_train 100s; the run's longest update + sync 110s, "
        "no save measured yet"
    )
    record.write_text(
        json.dumps({**times, "longest_update_and_sync_s": 110.0, "longest_save_s": 60.0})
    )
    assert stop_advice(str(tmp_path), 240).endswith(
        "longest save 60s: a stop needs up to about 200s, within STOP_GRACE_S=240s"
    )
    # 200 s does not fit 180: half as much again (300 s) in whole minutes, + 60 s after it
    assert stop_advice(str(tmp_path), 180).endswith(
        "more than STOP_GRACE_S=180s: this stop may come too late; submit the next run with "
        "sbatch --signal=B:USR1@360 and STOP_GRACE_S=300"
    )
