"""DRPO (and the baselines) under OpenRLHF's asynchronous training (``--train.async_enable``,
``--train.async_queue_size``) and partial rollout (``--train.partial_rollout_enable``).

OpenRLHF's ``PPOTrainerAsync`` (``trainer/ppo_trainer_async.py``) runs two Ray actors beside
each other: a generator, whose rollouts go through a queue of ``async_queue_size`` to a
trainer, which updates the actor and syncs the engines meanwhile. A lock (``VLLMLock``) keeps
generation, evaluation and syncs apart; under partial rollout generation goes on without it
and a sync pauses the engines instead (vLLM's ``pause_generation(mode="keep")``), so a
response may be finished by newer weights than started it. We replace the three classes in
its module (``upstream`` rows) with:

- ``_DRPOTrainingActor``: OpenRLHF's trainer with the synchronous path's hooks
  (``ray_actors.TrainerHooks``: the deal of whole groups or the shapers, the step line with
  the policy lag, the stop without a signal, the log-prob gap, graceful stop, checkpoints) and
  its weight check (``sync_check.VerifiedSyncTrainer``), which runs inside OpenRLHF's
  ``broadcast_to_vllm``, under its lock or pause, so the engines are checked on the weights
  just sent and told their version before anything generates with them.
- ``AsyncSamplesGenerator`` (in the generator's actor): the synchronous path's generator
  (stops, cancelling) that scores the weight probe a sync left, under the lock, on idle
  engines, before each rollout; and stops after ``--drpo.max_steps`` rollouts.
- ``AsyncRunBoard``: OpenRLHF's lock, plus what the two share: the step the run started at,
  the engines' weight version, the pending probe and the last one's metrics.

What is compared with what, now that the engines may be versions behind the trainer: the
digests at every sync compare the engines with the weights just sent, while nothing
generates; the probe compares the engines, idle, with the actor's scores of the same weights
(a probe superseded by a newer sync before the engines were idle is skipped, and said); the
rollout log-prob gap is held to its limit only on responses sampled wholly by the weights that
score them (pi_old: ``algo.policy_lag``), the others' gap (the policy's change since) is logged.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import ray
from openrlhf.trainer import ppo_trainer, ppo_trainer_async
from ray.exceptions import TaskCancelledError

from drpo_openrlhf import upstream
from drpo_openrlhf.runtime.graceful_stop import StopBeforeUpdate, stop_requested
from drpo_openrlhf.runtime.ray_actors import (
    StoppableSamplesGenerator,
    TrainerHooks,
    install_samples_generator,
)
from drpo_openrlhf.sync.sync_check import VerifiedSyncTrainer, probe_engines
from drpo_openrlhf.sync.weight_probe import ActorLimits


class _AsyncRunBoard(ppo_trainer_async.VLLMLock.__ray_actor_class__):
    """OpenRLHF's lock between generation, evaluation and syncs, and what its trainer and its
    generator share: the step the run started at, the weight version the engines were last
    sent, the weight probe a sync left for the engines, and the metrics of the last one run."""

    def __init__(self) -> None:
        super().__init__()
        self._start: int | None = None
        self._version: int | None = None
        self._version_changed = asyncio.Condition()
        self._probe: tuple | None = None
        self._probe_metrics: dict[str, float] = {}
        self._filter_reports: deque = deque()  # one per rollout queued, in the queue's order

    async def start(self, step: int) -> None:
        self._start = step
        await self.set_weight_version(step)

    async def start_step(self) -> int | None:
        return self._start

    async def set_weight_version(self, version: int) -> None:
        async with self._version_changed:
            self._version = version
            self._version_changed.notify_all()

    async def wait_for_version(self, version: int) -> None:
        """Until the engines were sent weights of ``version`` or later."""
        async with self._version_changed:
            await self._version_changed.wait_for(
                lambda: self._version is not None and self._version >= version
            )

    async def post_probe(
        self, when: str, ids: list[int], actor: list[float], kinds: list[str] | None
    ) -> str | None:
        """Leave a probe for the engines (``kinds``: ``VerifiedSyncTrainer._probe_kinds``);
        returns the ``when`` of one it replaces unrun."""
        replaced = self._probe[0] if self._probe else None
        self._probe = (when, ids, actor, kinds)
        return replaced

    async def take_probe(self) -> tuple | None:
        probe, self._probe = self._probe, None
        return probe

    async def post_probe_metrics(self, metrics: dict[str, float]) -> None:
        self._probe_metrics = metrics

    async def probe_metrics(self) -> dict[str, float]:
        return self._probe_metrics

    async def post_filter_report(self, report: Any) -> None:
        self._filter_reports.append(report)

    async def take_filter_report(self) -> Any:
        return self._filter_reports.popleft() if self._filter_reports else None


@contextmanager
def engines_held(board: Any) -> Iterator[None]:
    """The board's lock: no sync, evaluation or locked generation meanwhile."""
    ray.get(board.acquire.remote())
    try:
        yield
    finally:
        ray.get(board.release.remote())


class AsyncSamplesGenerator(StoppableSamplesGenerator):
    """The generator of an asynchronous run: before each rollout, the engines score the weight
    probe the last sync left (``sync_check.probe_engines``), under the lock (under partial
    rollout the generator holds none of its own), so no sync or evaluation moves them
    meanwhile and they are idle; after ``--drpo.max_steps`` rollouts of the run it makes none
    (the run's end)."""

    board: Any
    partial: bool
    produced = 0  # rollouts handed to the trainer
    _start: int | None = None
    _probe_limits: ActorLimits | None = None

    def run_steps(self) -> int:
        """The step the trainer reaches with the rollouts made so far."""
        if self._start is None:
            self._start = ray.get(self.board.start_step.remote())
        return self._start + self.produced

    def generate_samples(self, **generate_kwargs):
        max_steps = self.args.drpo_run.max_steps
        if max_steps is not None and self.run_steps() >= max_steps:
            return [], None, 0, True
        self._run_posted_probe()
        samples = super().generate_samples(**generate_kwargs)
        if samples[0]:  # the trainer's step line names what dynamic filtering took for it
            self.produced += 1
            ray.get(self.board.post_filter_report.remote(self.filter_report))
        return samples

    def _run_posted_probe(self) -> None:
        with engines_held(self.board) if self.partial else nullcontext():
            posted = ray.get(self.board.take_probe.remote())
            if posted is None:
                return
            when, ids, actor, kinds = posted
            if self._probe_limits is None:
                self._probe_limits = ActorLimits()
            guard = self.args.drpo_run.weight_probe
            limits = self._probe_limits
            metrics = probe_engines(self.vllm_engines, ids, actor, limits, guard, when, kinds)
        ray.get(self.board.post_probe_metrics.remote(metrics))


class FinalEvaluationQueue:
    """The generator's queue to the trainer, which runs ``before_done`` before it passes the
    generator's closing ``"done"`` on: OpenRLHF's asynchronous generator evaluates a step when
    it next takes a slot, which never comes after the run's last step."""

    def __init__(self, queue: Any, before_done: Callable[[], None]) -> None:
        self.queue, self._before_done = queue, before_done

    def put(self, item: Any, block: bool = True) -> None:
        if isinstance(item, str) and item == "done":
            self._before_done()
        self.queue.put(item, block=block)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


class _DRPOGenerateSamplesActor(ppo_trainer_async.GenerateSamplesActor.__ray_actor_class__):
    """OpenRLHF's asynchronous generator with ``AsyncSamplesGenerator``; a stop request ends
    it with ``"done"`` (the trainer saves its last finished step); the run's last step is
    evaluated, when one is due, before its ``"done"``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        install_samples_generator(self.samples_generator, AsyncSamplesGenerator)
        self.samples_generator.board = self.vllm_lock
        self.samples_generator.partial = self._partial_rollout
        self.rollout_queue = FinalEvaluationQueue(self.rollout_queue, self._evaluate_last_step)

    def _evaluate_last_step(self) -> None:
        """Evaluate the run's last step on its weights, if due, as OpenRLHF evaluates any
        other: a slot taken, under the lock, the result queued for the trainer to log."""
        step = self.samples_generator.run_steps()
        if not self._should_eval(step):
            return
        self.rollout_slots.get(block=True)  # the trainer gives it back for the result
        ray.get(self.vllm_lock.wait_for_version.remote(step))
        with engines_held(self.vllm_lock):
            metrics = self._run_eval()
        self._last_eval_step = step
        self.rollout_queue.queue.put(("eval", step, metrics), block=True)

    def fit(self, episode: int, total_consumed_prompts: int) -> None:
        try:
            super().fit(episode, total_consumed_prompts)
        except (StopBeforeUpdate, TaskCancelledError) as error:
            cancelled = isinstance(error, TaskCancelledError)
            if cancelled and not self.samples_generator.canceller.requested:
                raise
            self.rollout_queue.queue.put("done", block=True)


class _CheckedSyncs(VerifiedSyncTrainer, ppo_trainer.BasePPOTrainer):
    """``VerifiedSyncTrainer`` below OpenRLHF's ``TrainingActor`` in the trainer's method order:
    ``TrainingActor.broadcast_to_vllm`` takes the lock (and pauses the engines under partial
    rollout) around its parent's sync, which is then the checked one."""


class _DRPOTrainingActor(
    TrainerHooks, ppo_trainer_async.TrainingActor.__ray_actor_class__, _CheckedSyncs
):
    """OpenRLHF's asynchronous trainer with ``TrainerHooks`` and the checked sync. The engines'
    probe runs in the generator (``AsyncSamplesGenerator``); the run ends when the generator
    does (after ``--drpo.max_steps`` rollouts, the last evaluated first when due), or at a
    stop request with the last finished step saved."""

    _shows_policy_lag = True
    _policy_lag_bound = None  # the queue, the sample buffer and partial rollout decide it
    _rollout_filter_report = None  # the generator's, for the rollout being trained

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._install_trainer_hooks()

    def init_checkpoint_states(self):
        states = super().init_checkpoint_states()
        ray.get(self.vllm_lock.start.remote(states["global_step"]))
        return states

    def _post_probe(self, when: str, actor: list[float]) -> None:
        posted = self.vllm_lock.post_probe.remote(when, self._probe_ids, actor, self._probe_kinds)
        replaced = ray.get(posted)
        if replaced:
            print(
                f"drpo_openrlhf: weight probe {replaced} skipped: no rollout began before "
                f"the sync {when} (its digests were checked)",
                flush=True,
            )

    def train_step(self, rollout_samples, global_step: int):
        self._probe_metrics = ray.get(self.vllm_lock.probe_metrics.remote())  # the last one run
        self._rollout_filter_report = ray.get(self.vllm_lock.take_filter_report.remote())
        return super().train_step(rollout_samples, global_step)

    def _filter_report(self):
        return self._rollout_filter_report

    def broadcast_to_vllm(self) -> None:
        super().broadcast_to_vllm()
        ray.get(self.vllm_lock.set_weight_version.remote(self._weights_version))

    def _at_max_steps(self, global_step: int) -> None:
        """Nothing: the generator made no rollout after this step's, and ends the run."""

    def _cancelled_by_stop(self) -> bool:
        return False  # this actor sends no vLLM requests: the generator does

    def _after_fit(self) -> None:
        if stop_requested(self.args.ckpt.path):  # the generator stopped on the request
            raise StopBeforeUpdate


class _DRPOAsyncTrainer(ppo_trainer_async.PPOTrainerAsync.__ray_actor_class__):
    """OpenRLHF's ``PPOTrainerAsync`` building DRPO's lock, generator and trainer."""

    def __init__(self, *args, **kwargs) -> None:
        upstream.apply(
            "async_trainer",
            {
                "VLLMLock": AsyncRunBoard,
                "GenerateSamplesActor": DRPOGenerateSamplesActor,
                "TrainingActor": DRPOTrainingActor,
            },
        )
        super().__init__(*args, **kwargs)


AsyncRunBoard = ray.remote(num_cpus=0)(_AsyncRunBoard)
DRPOGenerateSamplesActor = ray.remote(_DRPOGenerateSamplesActor)
DRPOTrainingActor = ray.remote(_DRPOTrainingActor)
DRPOAsyncTrainer = ray.remote(_DRPOAsyncTrainer)
