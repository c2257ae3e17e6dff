"""DRPO under OpenRLHF's asynchronous training (``runtime/async_trainer.py``), without Ray: the
trainer, the generator and the board built by hand, OpenRLHF's own ``broadcast_to_vllm`` (its
lock, its pause under partial rollout) and ``fit`` loops run against stand-in engines, actor
group, lock and queues that record every call. The real pipeline: tests/test_e2e_async.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from openrlhf.trainer import ppo_trainer, ppo_trainer_async
from openrlhf.trainer.ray import vllm_engine
from openrlhf.utils.config import hierarchize
from test_graceful_stop import RecordingActorGroup, Tracker
from test_signal_watch import MIXED, N, rollout
from test_train_cli import BASE, entry_point  # noqa: F401 (a fixture)
from test_weight_probe import ActorGroup, Remote
from toy_base import FIXTURES
from transformers import AutoTokenizer

from drpo_openrlhf import train
from drpo_openrlhf.algo.config import DRPOConfig
from drpo_openrlhf.algo.policy_lag import policy_lag
from drpo_openrlhf.runtime import async_trainer, ray_actors
from drpo_openrlhf.runtime.graceful_stop import (
    STOP_FILE,
    RolloutCanceller,
    StepTimes,
    StopBeforeUpdate,
    StopRequested,
)
from drpo_openrlhf.runtime.openrlhf_cli import openrlhf_parser
from drpo_openrlhf.sync import sync_check, weight_version
from drpo_openrlhf.sync.engine_tag import ENGINE_KEY
from drpo_openrlhf.sync.logprob_gap import GapLimit, LogprobGapError
from drpo_openrlhf.sync.weight_probe import WeightProbeError
from drpo_openrlhf.update.signal_watch import SignalWatch

GENERATOR = ppo_trainer_async.GenerateSamplesActor.__ray_actor_class__
TRAINING = ppo_trainer_async.TrainingActor.__ray_actor_class__
IDENTITY = SimpleNamespace(get=lambda refs: refs)


def recorder(calls: list[str], name: str, result=None):
    def record(*args, **kwargs):
        calls.append(" ".join([name, *map(str, args)]))
        return result

    return Remote(record)


class Board:
    """The board's calls (``AsyncRunBoard``), recorded; it holds one posted probe."""

    def __init__(self, calls: list[str], start: int = 0) -> None:
        self.calls, self.posted, self.start = calls, None, start
        self.acquire = recorder(calls, "lock acquire")
        self.release = recorder(calls, "lock release")
        self.set_weight_version = recorder(calls, "board version")
        self.wait_for_version = recorder(calls, "wait for version")
        self.post_probe_metrics = recorder(calls, "board probe metrics")
        self.post_filter_report = Remote(lambda report: None)
        self.probe_metrics = Remote(lambda: {"drpo/probe_logprob_gap": 0.0})
        self.start_step = Remote(lambda: self.start)

        def post(when, ids, actor, kinds):
            calls.append(f"board post_probe {when}")
            self.posted = (when, ids, actor, kinds)

        def take():
            posted, self.posted = self.posted, None
            return posted

        self.post_probe, self.take_probe = Remote(post), Remote(take)


class Engine:
    """A vLLM engine actor's calls, recorded; ``offset`` moves its probe scores."""

    def __init__(self, index: int, calls: list[str], offset: float = 0.0) -> None:
        for method in ("pause_generation", "resume_generation", "set_weight_version"):
            setattr(self, method, recorder(calls, f"engine {index} {method}"))
        self.begin_weight_sync = recorder(calls, f"engine {index} begin_weight_sync")
        self.weight_sync_report = Remote(lambda: [])

        def probe(ids):
            calls.append(f"probe engine {index}")
            return [-1.0 - offset] * (len(ids) - 1)

        self.probe_logprobs = Remote(probe)


def args_of(tmp_path: Path, *flags: str, **run):
    args = hierarchize(
        openrlhf_parser().parse_args(["--ckpt.path", str(tmp_path), "--data.max_len", "64", *flags])
    )
    args.drpo_run = SimpleNamespace(
        **{"verify_weight_sync": True, "weight_probe": "all", "max_steps": None, **run}
    )
    return args


@pytest.fixture
def tokenizer():
    return AutoTokenizer.from_pretrained(FIXTURES / "qwen2")


@pytest.fixture
def stand_ins(monkeypatch):
    """Every module's Ray answers at once; the digest check recorded instead of run."""
    modules = (ppo_trainer_async, ppo_trainer, vllm_engine, sync_check, weight_version)
    for module in (*modules, async_trainer):
        monkeypatch.setattr(module, "ray", IDENTITY)
    calls: list[str] = []
    monkeypatch.setattr(sync_check, "check_sync", lambda *a, **k: calls.append("check"))
    return calls


def training_actor(calls, tmp_path, tokenizer, partial: bool):
    t = async_trainer._DRPOTrainingActor.__new__(async_trainer._DRPOTrainingActor)
    flags = ["--train.async_enable", *(["--train.partial_rollout_enable"] if partial else [])]
    t.args, t.tokenizer, t._partial_rollout = args_of(tmp_path, *flags), tokenizer, partial
    t.vllm_engines = [Engine(0, calls), Engine(1, calls)]
    t.vllm_lock, t.actor_model_group = Board(calls), ActorGroup(calls)
    t._weights_version, t._sync_when = 4, "after rollout step 4"
    return t


CHECKED_SYNC = [
    "engine 0 begin_weight_sync",
    "engine 1 begin_weight_sync",
    "broadcast_to_vllm",
    "sent_weight_digests",
    "check",
    "actor probe",
    "board post_probe after rollout step 4",
    "engine 0 set_weight_version 4",
    "engine 1 set_weight_version 4",
]


@pytest.mark.parametrize("partial", [False, True])
def test_each_sync_is_checked_and_its_version_told_inside_openrlhfs_lock(
    stand_ins, tmp_path, tokenizer, partial
):
    """OpenRLHF's ``TrainingActor.broadcast_to_vllm`` takes the lock (and, under partial
    rollout, pauses the engines) around its parent's sync: the checked one, so the digests
    compare the engines with the weights just sent, and the engines learn the new version,
    before anything can generate with them. The probe is left on the board."""
    t = training_actor(stand_ins, tmp_path, tokenizer, partial)
    t.broadcast_to_vllm()
    paused = [f"engine {i} pause_generation" for i in (0, 1)] if partial else []
    resumed = [f"engine {i} resume_generation" for i in (0, 1)] if partial else []
    assert stand_ins == [
        "lock acquire",
        *paused,
        *CHECKED_SYNC,
        *resumed,
        "lock release",
        "board version 4",
    ]


def test_the_trainers_method_order_puts_the_check_inside_the_lock():
    """What the test above relies on, and breaks if the bases are reordered."""
    names = [c.__name__ for c in async_trainer._DRPOTrainingActor.__mro__]
    assert names.index("TrainingActor") < names.index("VerifiedSyncTrainer")
    assert names.index("VerifiedSyncTrainer") < names.index("BasePPOTrainer")
    assert names.index("TrainerHooks") < names.index("TrainingActor")


def samples_generator(calls, tmp_path, tokenizer, partial: bool, offset: float = 0.0, **run):
    g = async_trainer.AsyncSamplesGenerator.__new__(async_trainer.AsyncSamplesGenerator)
    g.args, g.tokenizer = args_of(tmp_path, "--train.async_enable", **run), tokenizer
    g.vllm_engines = [Engine(0, calls), Engine(1, calls, offset)]
    g.board, g.partial = Board(calls), partial
    g.canceller = RolloutCanceller(str(tmp_path), cancel=print)
    return g


@pytest.fixture
def generation(monkeypatch, stand_ins):
    """The synchronous path's generation, recorded as ``generate``, returning one rollout."""

    def generate(self, **kwargs):
        stand_ins.append("generate")
        return [object()], None, 4, False

    monkeypatch.setattr(ray_actors.StoppableSamplesGenerator, "generate_samples", generate)
    return stand_ins


@pytest.mark.parametrize("partial", [False, True])
def test_the_engines_score_a_posted_probe_before_the_next_rollout_once(
    generation, tmp_path, tokenizer, partial
):
    """Without partial rollout OpenRLHF's generator holds the lock around the rollout already;
    under it the generator holds none, so it takes the lock for the probe: no sync, and no
    evaluation, moves the engines while they score it, and they are idle."""
    g = samples_generator(generation, tmp_path, tokenizer, partial)
    g.board.posted = ("after rollout step 2", [1, 2, 3], [-1.0, -1.0], None)
    g.generate_samples()
    probed = ["probe engine 0", "probe engine 1"]
    locked = ["lock acquire", *probed, "lock release"] if partial else probed
    metrics = "board probe metrics {'drpo/probe_logprob_gap': 0.0, "
    assert generation[: len(locked)] == locked
    assert generation[len(locked)].startswith(metrics) and generation[-1] == "generate"
    generation.clear()
    g.generate_samples()  # no sync since: nothing to probe
    assert generation == (["lock acquire", "lock release", "generate"] if partial else ["generate"])


def test_an_engine_that_scores_otherwise_stops_the_run_before_the_rollout(
    generation, tmp_path, tokenizer
):
    g = samples_generator(generation, tmp_path, tokenizer, partial=True, offset=1e-3)
    g.board.posted = ("after rollout step 2", [1, 2, 3], [-1.0, -1.0], None)
    with pytest.raises(WeightProbeError, match="weight probe after rollout step 2 failed"):
        g.generate_samples()
    assert generation[-1] == "lock release" and "generate" not in generation


def test_the_generator_makes_no_rollout_after_the_max_steps(generation, tmp_path, tokenizer):
    g = samples_generator(generation, tmp_path, tokenizer, partial=False, max_steps=3)
    g.board.start = 1  # a run resumed at step 1: two rollouts to go
    produced = [g.generate_samples()[0] for _ in range(3)]
    assert [bool(p) for p in produced] == [True, True, False]
    assert generation == ["generate", "generate"] and g.run_steps() == 3
    assert g.generate_samples()[3] is True  # exhausted: OpenRLHF's loop ends, then the run


class Queue:
    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def put(self, item, block=True):
        self.calls.append(f"{self.name} put {item[:2] if isinstance(item, tuple) else item}")

    def get(self, block=True):
        self.calls.append(f"{self.name} get")
        return 0


def generator_actor(calls, tmp_path, steps: int):
    a = async_trainer._DRPOGenerateSamplesActor.__new__(async_trainer._DRPOGenerateSamplesActor)
    a.args = args_of(tmp_path, "--train.async_enable", "--eval.steps", "2")
    a.eval_dataloader, a._last_eval_step = ["prompts"], -1
    a.samples_generator = SimpleNamespace(
        run_steps=lambda: steps, canceller=RolloutCanceller(str(tmp_path), cancel=print)
    )
    a.vllm_lock, a.rollout_slots = Board(calls), Queue(calls, "slots")
    a.rollout_queue = async_trainer.FinalEvaluationQueue(
        Queue(calls, "rollouts"), a._evaluate_last_step
    )
    a._run_eval = lambda: calls.append("evaluate") or {"eval_toy_pass1": 0.5}
    return a


def test_the_last_step_is_evaluated_on_its_weights_before_the_generators_done(stand_ins, tmp_path):
    """A slot taken (the trainer gives one back for every evaluation), the engines holding
    the last step's weights, under the lock; then ``done``. A last step no evaluation is due
    at just ends."""
    calls: list[str] = []
    generator_actor(calls, tmp_path, steps=4).rollout_queue.put("done", block=True)
    assert calls == [
        "slots get",
        "wait for version 4",
        "lock acquire",
        "evaluate",
        "lock release",
        "rollouts put ('eval', 4)",
        "rollouts put done",
    ]
    calls.clear()
    generator_actor(calls, tmp_path, steps=3).rollout_queue.put("done", block=True)
    assert calls == ["rollouts put done"]


def test_a_stop_request_ends_the_generator_with_done_and_no_evaluation(
    monkeypatch, stand_ins, tmp_path
):
    calls: list[str] = []

    def stopped(self, episode, total_consumed_prompts):
        raise StopBeforeUpdate

    monkeypatch.setattr(GENERATOR, "fit", stopped)
    generator_actor(calls, tmp_path, steps=4).fit(0, 0)
    assert calls == ["rollouts put done"]


def stopping_trainer(tmp_path: Path):
    """The asynchronous trainer with what its save path reads (``test_graceful_stop``)."""
    t = async_trainer._DRPOTrainingActor.__new__(async_trainer._DRPOTrainingActor)
    t.args = args_of(tmp_path, "--train.async_enable", "--ckpt.save_steps", "5")
    t.experience_maker = SimpleNamespace()
    t.actor_model_group, t.critic_model_group = RecordingActorGroup(), None
    t.wandb_logger, t.tensorboard_logger = None, Tracker()
    t.best_eval_metric_key = t.best_eval_metric_value = t._latest_eval_metric_value = None
    t._step_times, t._finished = StepTimes(str(tmp_path)), None
    t._gap_limit = GapLimit(None, exact_start=True, honest=0.002, honest_step=1)
    return t


def test_a_generator_stopped_on_request_leaves_the_trainer_to_save_its_last_step(
    monkeypatch, tmp_path
):
    """OpenRLHF's trainer loop ends on the generator's ``done``; the request file is still
    there, so the trainer saves the last step it finished (step 2, not a save step) and the
    run ends as a stop."""
    monkeypatch.setattr(ppo_trainer, "ray", IDENTITY)

    def fit(self, global_step=0):
        for step in (1, 2):
            self.save_logs_and_checkpoints(step, {}, {"global_step": step})
        (tmp_path / STOP_FILE).touch()  # the generator saw it and sent done

    monkeypatch.setattr(TRAINING, "fit", fit)
    t = stopping_trainer(tmp_path)
    with pytest.raises(StopRequested, match="saved global_step2, stopping"):
        t.fit()
    assert [tag for tag, _ in t.actor_model_group.saved] == ["global_step2"]
    assert t.tensorboard_logger.closed


def test_without_a_request_the_generators_done_ends_the_run(monkeypatch, tmp_path):
    monkeypatch.setattr(ppo_trainer, "ray", IDENTITY)
    monkeypatch.setattr(TRAINING, "fit", lambda self, global_step=0: None)
    stopping_trainer(tmp_path).fit()  # returns: the driver saves the model


def test_max_steps_leave_the_end_to_the_generator(monkeypatch, tmp_path):
    """The synchronous trainer leaves OpenRLHF's loop at the last step; the asynchronous one
    saves it and waits for the generator's last evaluation and ``done``."""
    monkeypatch.setattr(ppo_trainer, "ray", IDENTITY)
    t = stopping_trainer(tmp_path)
    t.args.drpo_run.max_steps = 2
    t.save_logs_and_checkpoints(2, {}, {"global_step": 2})  # no _MaxStepsReached
    assert [tag for tag, _ in t.actor_model_group.saved] == []


def experiences_with(versions: list[tuple[int, int]], gaps: list[float]):
    """``rollout(MIXED)``'s two batches, each row sampled by ``versions[i]`` with a log-prob
    gap ``gaps[i]`` on every token, all by engine 0."""
    batches, row = rollout(MIXED), 0
    for batch in batches:
        rows = batch.scores.numel()
        actor = torch.full((rows, 3), -1.0)
        batch.action_log_probs, batch.action_mask = actor, torch.ones(rows, 3)
        batch.rollout_log_probs = actor + torch.tensor(gaps[row : row + rows])[:, None]
        batch.info[ENGINE_KEY] = torch.zeros(rows, dtype=torch.long)
        batch.info[weight_version.FIRST_KEY] = torch.tensor([v[0] for v in versions[row:]][:rows])
        batch.info[weight_version.LAST_KEY] = torch.tensor([v[1] for v in versions[row:]][:rows])
        row += rows
    return batches


def hooked_trainer(cls, honest: float = 0.002):
    t = cls.__new__(cls)
    t.args = SimpleNamespace(
        drpo=DRPOConfig(),
        rollout=SimpleNamespace(n_samples_per_prompt=N),
        train=SimpleNamespace(batch_size=N),  # one group a step: every rollout trains
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator="group_norm")),
    )
    t.experience_maker, t._signal_watch = SimpleNamespace(), SignalWatch(3)
    t._gap_limit = GapLimit(None, exact_start=True, honest=honest, honest_step=1)
    t._weights_version, t._rollout_step = 5, 6
    return t


STALE_BIG_GAP = [(4, 4)] * 4 + [(5, 5)] * 4, [0.5] * 4 + [0.001] * 4


def test_only_responses_of_the_actors_own_weights_are_held_to_the_gap_limit(monkeypatch, capsys):
    """One version behind, an honest engine's responses differ from pi_old by the policy's
    change (here 0.5 nats a token, far over 10 x the honest 0.002): logged, not a stop. The
    same gap on responses of the actor's own weights stops the run."""
    monkeypatch.setattr(ppo_trainer.BasePPOTrainer, "_compute_rollout_stats", lambda s, e: {})
    t = hooked_trainer(async_trainer._DRPOTrainingActor)
    stats = t._compute_rollout_stats(experiences_with(*STALE_BIG_GAP))
    assert stats["drpo/rollout_logprob_gap_lagged"] == pytest.approx(0.5, rel=1e-4)
    assert stats["drpo/rollout_logprob_gap"] == pytest.approx(0.001, rel=1e-3)
    assert stats["drpo/policy_lag_max"] == 1.0 and stats["drpo/stale_response_fraction"] == 0.5
    line = capsys.readouterr().out
    assert "drpo_openrlhf: step 6: correct 25%, learnable groups 1/2, policy lag 0-1 |" in line
    fresh = [(5, 5)] * 8, STALE_BIG_GAP[1]
    with pytest.raises(LogprobGapError, match="rollout step 6"):
        t._compute_rollout_stats(experiences_with(*fresh))


def test_a_synchronous_run_stops_on_a_response_of_older_weights(monkeypatch):
    monkeypatch.setattr(ppo_trainer.BasePPOTrainer, "_compute_rollout_stats", lambda s, e: {})
    t = hooked_trainer(ray_actors._GroupAwarePPOTrainer)
    with pytest.raises(RuntimeError, match="an engine missed a weight sync"):
        t._compute_rollout_stats(experiences_with(*STALE_BIG_GAP))
    lag = policy_lag([(5, 5)], 5)
    assert t._policy_lag([(5, 5)], step=6) == lag  # its own weights: no lag, no line change


def test_the_board_keeps_the_newest_probe_and_wakes_a_wait_for_a_version():
    async def scenario():
        board = async_trainer._AsyncRunBoard()
        await board.start(3)
        assert await board.start_step() == 3
        assert await board.post_probe("after rollout step 4", [1], [0.0], None) is None
        replaced = await board.post_probe("after rollout step 5", [1], [0.0], ["cpu"])
        assert replaced == "after rollout step 4"  # the trainer says it was skipped
        assert (await board.take_probe())[0] == "after rollout step 5"
        assert await board.take_probe() is None
        for report in ("rollout 1", None, "rollout 3"):  # dynamic filtering's, per rollout
            await board.post_filter_report(report)
        assert [await board.take_filter_report() for _ in range(4)] == [
            "rollout 1",
            None,
            "rollout 3",
            None,
        ]
        waiting = asyncio.ensure_future(board.wait_for_version(5))
        await board.set_weight_version(4)
        await asyncio.sleep(0)
        assert not waiting.done()
        await board.set_weight_version(5)
        await asyncio.wait_for(waiting, 1)

    asyncio.run(scenario())


def test_async_and_partial_rollout_are_accepted_and_what_cannot_work_is_refused(capsys):
    for flags in (["--train.async_enable", "--train.async_queue_size", "2"],):
        train.parse([*BASE, *flags])
    train.parse([*BASE, "--train.async_enable", "--train.partial_rollout_enable"])
    refused = {
        "with --vllm.enable_prefix_caching": [
            "--train.async_enable",
            "--train.partial_rollout_enable",
            "--vllm.enable_prefix_caching",
        ],
        "requires --train.async_enable": ["--train.partial_rollout_enable"],
        "not supported with --vllm.enable_sleep": [
            "--train.async_enable",
            "--train.colocate_all",
            "--vllm.enable_sleep",
        ],
    }
    for message, flags in refused.items():
        with pytest.raises(SystemExit) as exit_info:
            train.parse([*BASE, *flags])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, message
    train.parse([*BASE, "--train.async_enable", "--vllm.enable_prefix_caching"])  # no pause


def test_the_entry_point_runs_openrlhfs_async_trainer_as_drpos(entry_point, monkeypatch):  # noqa: F811
    monkeypatch.setattr(
        ppo_trainer_async, "PPOTrainerAsync", ppo_trainer_async.PPOTrainerAsync
    )  # restored after the test
    train.main([*BASE, "--train.async_enable"])
    assert ppo_trainer_async.PPOTrainerAsync is async_trainer.DRPOAsyncTrainer
    assert entry_point["args"].train.async_enable
