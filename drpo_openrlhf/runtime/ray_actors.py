"""The driver-side trainer actor a DRPO (or baseline) run uses in place of OpenRLHF's
``PPOTrainer``, and the hooks its asynchronous twin shares (``async_trainer``); the policy
and engine actors are ``policy_actors`` and ``engine_actors``, so that no actor's process
imports another one's side.

Ray forbids subclassing a ``@ray.remote`` class, so we subclass the undecorated classes and
decorate ours. They live in an importable module: Ray pickles them by reference, so every
node must be able to ``import drpo_openrlhf`` (same environment, or a ``runtime_env``).
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import nullcontext

import ray
import torch
from openrlhf.trainer import ppo_trainer
from openrlhf.trainer.ppo_utils import samples_generator
from openrlhf.trainer.ray import vllm_engine
from ray.exceptions import TaskCancelledError

from drpo_openrlhf import upstream
from drpo_openrlhf.algo.group_shaper import GroupRewardShaper
from drpo_openrlhf.algo.policy_lag import PolicyLag, fresh_rows, policy_lag
from drpo_openrlhf.runtime.dynamic_filter import FilteringSamplesGenerator
from drpo_openrlhf.runtime.graceful_stop import (
    RolloutCanceller,
    StepTimes,
    StopBeforeUpdate,
    StopRequested,
    saving_this_step,
    stop_message,
    stop_requested,
)
from drpo_openrlhf.sync import engine_start
from drpo_openrlhf.sync.engine_tag import (
    engine_tags,
    pop_engine_tags,
    tag_engines,
)
from drpo_openrlhf.sync.logprob_gap import GapLimit, gaps_by_engine, logprob_gap, pooled_gap
from drpo_openrlhf.sync.sync_check import (
    ProbingSamplesGenerator,
    VerifiedSyncTrainer,
)
from drpo_openrlhf.sync.weight_version import (
    pop_version_tags,
    response_versions,
    tag_version,
)
from drpo_openrlhf.update.baseline_experience import ShapingExperienceMaker, advantage_signal_stats
from drpo_openrlhf.update.experience import GroupTaggingExperienceMaker
from drpo_openrlhf.update.signal_watch import (
    NoLearningSignalError,
    SignalWatch,
    rollout_signal,
)

logger = logging.getLogger(__name__)
# our keys in OpenRLHF's checkpoint client state (the actor's: policy_actors.DRPO_STATE)
SHAPING_STATE, GAP_STATE = "shaping", "logprob_gap"


def gap_state_for(saved: dict | None, param_dtype: str) -> tuple[dict | None, str | None]:
    """The checkpoint's honest-gap state if it was measured in this run's dtype, else None
    and why: an fp32 gap (about 2e-6 on CPU) would stop a bf16 resume (about 0.008) at its
    first rollout. Checkpoints that name no dtype were all bf16."""
    if saved is None or saved.get("param_dtype", "bf16") == param_dtype:
        return saved, None
    return None, (
        f"the checkpoint's honest rollout log-prob gap ({saved['honest']:.3g}) was measured "
        f"in {saved.get('param_dtype', 'bf16')}; this run computes in {param_dtype}, so its "
        "first rollout is not held to it (with the weight check on, it measures the gap anew)"
    )


def rollout_logprob_stats(
    experiences: list, limit: GapLimit, step: int, fresh: list[list[bool]] | None = None
) -> dict[str, float]:
    """The rollout's mean |vLLM - actor| token log-prob gap per engine
    (``drpo/rollout_logprob_gap/engine_<i>``), pooled over engines
    (``drpo/rollout_logprob_gap``), its largest token (``_max``), the per-engine limit that
    applied (``_limit``) and the honest gap it derives from (``_honest``); raises
    ``LogprobGapError`` naming the engines over the limit and the step.

    ``fresh`` says, per experience, which rows were sampled by the very weights the actor
    scored them with (all when None). Only those are held to the limit: the others' gap holds
    the policy's own change since (asynchronous training, ``algo.policy_lag``), and is logged
    as ``drpo/rollout_logprob_gap_lagged``; the weights they were sampled by were checked at
    their sync."""
    batches, lagged = [], []
    for e, rows in zip(experiences, fresh or [None] * len(experiences), strict=True):
        if e.rollout_log_probs is None:
            continue
        mask = e.action_mask.bool()
        if rows is not None:
            rows = torch.tensor(rows, dtype=torch.bool)[:, None]
            lagged.append(logprob_gap(e.rollout_log_probs, e.action_log_probs, mask & ~rows))
            mask = mask & rows
        batches.append((engine_tags(e), e.rollout_log_probs, e.action_log_probs, mask))
    stats = {}
    if any(count for _, _, count in lagged):
        stats["drpo/rollout_logprob_gap_lagged"] = pooled_gap(lagged)[0]
    gaps = gaps_by_engine(batches)
    if not gaps:
        return stats
    limit_value, line = limit.check(gaps, step)
    if line:
        print(f"drpo_openrlhf: {line}", flush=True)  # a Ray actor logs no INFO
    mean, largest = pooled_gap(gaps.values())
    stats |= {
        "drpo/rollout_logprob_gap": mean,
        "drpo/rollout_logprob_gap_max": largest,
        "drpo/rollout_logprob_gap_limit": limit_value,
    }
    if limit.honest is not None:
        stats["drpo/rollout_logprob_gap_honest"] = limit.honest
    return stats | {f"drpo/rollout_logprob_gap/engine_{i}": g[0] for i, g in gaps.items()}


def _sampling_params_with_logprobs(sampling_params):
    """OpenRLHF asks vLLM for the sampled tokens' log-probs only for its importance-sampling
    correction (``samples_generator.py: _dispatch_prompts_to_vllm``); we always need them."""

    def build(**kwargs):
        if kwargs.get("logprobs") is None:
            kwargs["logprobs"] = 1
        return sampling_params(**kwargs)

    return build


def configure_positive_reward(engines: list, args) -> None:
    """Load ``--drpo.positive_reward`` in every vLLM engine, unless it is the length reward
    (the actor computes that one). A plugin that fails to load there stops the run now."""
    drpo = args.drpo
    if drpo.length_positive_reward or not engines:
        return
    spec, c, shape = drpo.positive_reward, drpo.length_c, drpo.length_reward
    ray.get([e.configure_positive_reward.remote(spec, c, shape) for e in engines])
    logger.info("positive reward %s loaded in %d engine(s)", drpo.positive_reward, len(engines))


def bind_answer_format(engines: list, args) -> None:
    """Bind the run's answer format (decided by the entry point: ``--drpo.answer_format``) to
    the reward function in every vLLM engine, as ``require_think_end``; the value travels
    with the call, so an engine on any node grades as the driver decided. A reward function
    that does not take it grades by its own rules; with the flag given, that stops the run."""
    answer_format = args.drpo_run.answer_format
    if not engines:
        return
    options = {"require_think_end": answer_format.require_think_end}
    bound = ray.get([e.bind_reward_options.remote(options) for e in engines])
    unbound = sum("require_think_end" not in names for names in bound)
    if unbound and answer_format.explicit:
        raise RuntimeError(
            f"{answer_format.reason}: the reward function of {unbound} of {len(engines)} vLLM "
            "engine(s) takes no require_think_end keyword, so the flag cannot reach it"
        )
    print(
        f"drpo_openrlhf: require_think_end={answer_format.require_think_end} bound to the "
        f"reward in {len(engines) - unbound} of {len(engines)} vLLM engine(s)",
        flush=True,
    )


class _MaxStepsReached(Exception):
    """Raised after the checkpoint of the last step to leave OpenRLHF's episode loops."""


class StoppableSamplesGenerator(
    ProbingSamplesGenerator, FilteringSamplesGenerator, samples_generator.SamplesGenerator
):
    """OpenRLHF's generator whose rollouts a stop request can drop (``graceful_stop``): it
    looks for the request before generating and once the rollout is complete, and its vLLM
    requests go to a ``RolloutCanceller`` meanwhile. The engines score a pending weight probe
    before its first request (``sync_check.ProbingSamplesGenerator``); dynamic filtering keeps
    the run's groups (``dynamic_filter``)."""

    canceller: RolloutCanceller

    def _dispatch_prompts_to_vllm(self, *args, **kwargs):
        refs = super()._dispatch_prompts_to_vllm(*args, **kwargs)
        self.canceller.track(refs)
        return refs

    def generate_samples(self, **generate_kwargs):
        if stop_requested(self.args.ckpt.path):
            raise StopBeforeUpdate
        try:
            samples = super().generate_samples(**generate_kwargs)
        except TaskCancelledError:
            if not self.canceller.requested:
                raise
            if self.args.vllm.enable_sleep:  # as after any generation: the save needs memory
                vllm_engine.batch_vllm_engine_call(self.vllm_engines, "sleep")
            raise StopBeforeUpdate from None
        finally:
            self.canceller.finished()
        if self.canceller.requested or stop_requested(self.args.ckpt.path):
            raise StopBeforeUpdate
        return samples


def install_samples_generator(generator, cls: type) -> None:
    """``cls`` (a ``StoppableSamplesGenerator``) as the class of OpenRLHF's samples generator,
    with its canceller, and vLLM asked for every sampled token's log-prob in this process."""
    upstream.apply("ppo_trainer", {"SamplingParams": _sampling_params_with_logprobs})
    upstream.swap_class(generator, cls)
    generator.canceller = RolloutCanceller(generator.args.ckpt.path, ray.cancel)


class TrainerHooks:
    """What DRPO's driver-side trainer adds to OpenRLHF's, synchronous
    (``_GroupAwarePPOTrainer``) or asynchronous (``async_trainer``), installed by
    ``_install_trainer_hooks`` once OpenRLHF's constructor ran: the experience-maker hook
    (group tags for DRPO, reward shaping for baselines); the shaper's state (HAPO's history) in
    OpenRLHF's checkpoints; each rollout's policy lag, log-prob gap and step line, and the stop
    of a run without a learning signal before its update (``signal_watch``); the stop after
    ``--drpo.max_steps`` rollout steps, or at the next safe point once a stop is requested,
    with a checkpoint of the last finished step (``graceful_stop``)."""

    _shows_policy_lag = False  # the step line names the policy lag (asynchronous runs)
    _policy_lag_bound: int | None = 0  # the most a response may lag: none behind, in sync

    def _install_trainer_hooks(self) -> None:
        run = self.args.drpo_run
        self._gap_limit = GapLimit(run.max_logprob_gap, run.verify_weight_sync)
        self._signal_watch = SignalWatch(run.max_steps_without_signal)
        if run.method:
            upstream.swap_class(self.experience_maker, ShapingExperienceMaker)
            self.experience_maker.shaper = GroupRewardShaper(
                run.method, self.args.rollout.n_samples_per_prompt, **run.params
            )
        else:
            upstream.swap_class(self.experience_maker, GroupTaggingExperienceMaker)
        self._step_times = StepTimes(self.args.ckpt.path)
        # (step, client states at its end, saved?) of the last finished step of this run
        self._finished: tuple[int, dict, bool] | None = None

    @property
    def _shaper(self) -> GroupRewardShaper | None:
        return getattr(self.experience_maker, "shaper", None)

    def train_step(self, rollout_samples, global_step: int):
        self._rollout_step = global_step + 1  # the step this rollout's update will make
        return super().train_step(rollout_samples, global_step)

    def _compute_rollout_stats(self, experiences):
        stats = super()._compute_rollout_stats(experiences)
        step = getattr(self, "_rollout_step", 0)
        versions = [response_versions(e) for e in experiences]
        lag = self._policy_lag([v for rows in versions for v in rows], step)
        fresh = [fresh_rows(rows, self._weights_version) for rows in versions]
        stats.update(rollout_logprob_stats(experiences, self._gap_limit, step, fresh))
        stats.update(lag.metrics())
        pop_engine_tags(experiences)  # not metrics for the actors to log
        pop_version_tags(experiences)
        if self._shaper is not None:
            stats.update(advantage_signal_stats(experiences))
        stats.update(self._watch_signal(experiences, lag))
        return stats

    def _policy_lag(self, versions: list, step: int) -> PolicyLag:
        """The rollout's lag behind the actor's weights (``algo.policy_lag``); more than
        ``_policy_lag_bound`` stops the run: a synchronous run's engines sample the actor's
        own weights, so a response from older ones means a sync never reached its engine."""
        lag = policy_lag(versions, self._weights_version)
        bound = self._policy_lag_bound
        if bound is not None and lag.oldest > bound:
            raise RuntimeError(
                f"rollout step {step}: responses sampled by weight version "
                f"{self._weights_version - lag.oldest}, {lag.oldest} behind the actor's "
                f"{self._weights_version}, in a synchronous run: an engine missed a weight sync"
            )
        return lag

    def _watch_signal(self, experiences, lag: PolicyLag | None = None) -> dict[str, float]:
        """Print the rollout's step line (with what dynamic filtering dropped to fill it); stop
        the run, before the update, once too many rollouts in a row had nothing to learn
        from (``signal_watch``)."""
        config = None if self._shaper is not None else self.args.drpo
        n = self.args.rollout.n_samples_per_prompt
        rollout = rollout_signal(
            experiences,
            config,
            n,
            self.args.algo.advantage.estimator,
            groups_per_step=None if config is None else self.args.train.batch_size // n,
        )
        filtered = self._filter_report()
        notes = [lag.describe() if lag and self._shows_policy_lag else None]
        notes.append(filtered.line() if filtered else None)
        note = ", ".join(n for n in notes if n) or None
        line = self._signal_watch.observe(getattr(self, "_rollout_step", 0), rollout, note)
        print(f"drpo_openrlhf: {line}", flush=True)  # a Ray actor logs no INFO
        self._signal_watch.check()
        return self._signal_watch.stats() | (filtered.stats() if filtered else {})

    def _filter_report(self):
        """What dynamic filtering took to fill this rollout (``dynamic_filter.FilterReport``),
        or None."""
        return getattr(getattr(self, "samples_generator", None), "filter_report", None)

    def _with_gap_state(self, client_states: dict | None) -> dict:
        """The honest log-prob gap goes with every checkpoint, so a resume is held to it, with
        the dtype it was measured in."""
        state = self._gap_limit.state_dict()
        if state is not None:
            state = {**state, "param_dtype": self.args.ds.param_dtype}
        return {**(client_states or {}), GAP_STATE: state}

    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        client_states = self._with_gap_state(client_states)
        if self._shaper is not None:
            client_states = {**(client_states or {}), SHAPING_STATE: self._shaper.state_dict()}
        stopping = stop_requested(self.args.ckpt.path)
        saving = stopping or global_step % self.args.ckpt.save_steps == 0
        # as OpenRLHF gets them: a stop before the next update saves this step with them
        self._finished = (global_step, copy.deepcopy(client_states), saving)
        started = time.monotonic()
        with saving_this_step(self.args.ckpt) if stopping else nullcontext():
            super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        save_s = time.monotonic() - started if saving else None
        self._step_times.record(global_step, logs_dict or {}, save_s)
        if self.tensorboard_logger:  # a run that stops on a fault keeps every step's metrics
            self.tensorboard_logger.writer.flush()
        if stopping:
            raise StopRequested(f"stop requested: saved global_step{global_step}, stopping")
        max_steps = self.args.drpo_run.max_steps
        if max_steps is not None and global_step >= max_steps:
            self._at_max_steps(global_step)

    def _at_max_steps(self, global_step: int) -> None:
        """The last step is saved: end OpenRLHF's loop, after this step's evaluation when one
        is due (OpenRLHF's synchronous loop evaluates it after this call)."""
        if global_step % self.args.eval.steps == 0 and self.eval_dataloader:
            self._evaluate_then_stop = True
        else:
            raise _MaxStepsReached

    def save_best_checkpoint(self, eval_metrics, global_step, client_states=None):
        client_states = self._with_gap_state(client_states)
        super().save_best_checkpoint(eval_metrics, global_step, client_states)
        if getattr(self, "_evaluate_then_stop", False):  # the last step's evaluation is done
            raise _MaxStepsReached

    def ppo_train(self, global_steps: int):
        if stop_requested(self.args.ckpt.path):  # the last safe point before the weights change
            raise StopBeforeUpdate
        status = super().ppo_train(global_steps)
        self._weights_version = global_steps + 1  # what the sync after it sends
        return status

    def _save_finished_step(self) -> str:
        """Save the last finished step (unless a save has), with its own client states: the
        actor has not changed since. Returns the run's last line."""
        if self._finished is None:
            return stop_message(None, saved_now=False)
        step, client_states, saved = self._finished
        if not saved:
            loggers = self.wandb_logger, self.tensorboard_logger
            self.wandb_logger = self.tensorboard_logger = None  # the step is logged already
            try:
                with saving_this_step(self.args.ckpt):
                    super().save_logs_and_checkpoints(step, {}, client_states)
            finally:
                self.wandb_logger, self.tensorboard_logger = loggers
        return stop_message(step, saved_now=not saved)

    def fit(self, global_step: int = 0) -> None:
        try:
            super().fit(global_step)
            self._after_fit()
        except _MaxStepsReached:
            logger.info("stopping after --drpo.max_steps=%d steps", self.args.drpo_run.max_steps)
            self._close_trackers()
        except (StopRequested, NoLearningSignalError):  # the driver ends the run on them
            self._close_trackers()
            raise
        except (StopBeforeUpdate, TaskCancelledError) as error:
            cancelled = isinstance(error, TaskCancelledError)  # an evaluation's requests
            if cancelled and not self._cancelled_by_stop():
                raise
            message = self._save_finished_step()
            self._close_trackers()
            raise StopRequested(message) from None

    def _after_fit(self) -> None:
        """OpenRLHF's loop ended by itself (its data, or the asynchronous generator's end)."""

    def _cancelled_by_stop(self) -> bool:
        """Whether vLLM requests were cancelled by a stop request (not by a fault)."""
        return self.samples_generator.canceller.requested

    def _close_trackers(self) -> None:
        for tracker in (self.wandb_logger, self.tensorboard_logger):
            if tracker:
                tracker.close()

    def _prepare_engines(self) -> None:
        """Wait for the engines (one that failed to start is named first), then tell them what
        the run needs of them. Not in the constructor: OpenRLHF's driver starts the actors'
        models only once this trainer is constructed, so waiting there would run the
        engines' start and DeepSpeed's set-up one after the other instead of side by side."""
        engine_start.wait_for_engines(self.vllm_engines)
        tag_engines(self.vllm_engines)  # each response names its engine (per-engine gap)
        bind_answer_format(self.vllm_engines, self.args)  # DRPO and the baselines alike
        if not self.args.drpo_run.method:
            configure_positive_reward(self.vllm_engines, self.args)

    def init_checkpoint_states(self):
        """The start of ``fit`` (OpenRLHF's, or the asynchronous trainer's before its
        generator starts): the engines are prepared before any sync or rollout."""
        self._prepare_engines()
        states = super().init_checkpoint_states()
        if self._shaper is not None and SHAPING_STATE in states:
            self._shaper.load_state_dict(states[SHAPING_STATE])
        saved, note = gap_state_for(states.get(GAP_STATE), self.args.ds.param_dtype)
        if note:
            print(f"drpo_openrlhf: {note}", flush=True)  # a Ray actor logs no INFO
        self._gap_limit.load_state_dict(saved)
        self._weights_version = states["global_step"]
        if not self._weights_version:  # a resumed run's engines are told at its first sync
            tag_version(self.vllm_engines, 0)  # the weights vLLM loaded from disk
        return states


class _GroupAwarePPOTrainer(
    TrainerHooks, VerifiedSyncTrainer, ppo_trainer.PPOTrainer.__ray_actor_class__
):
    """OpenRLHF's synchronous trainer with ``TrainerHooks``; its generation stops on a stop
    request (``StoppableSamplesGenerator``); after ``--drpo.max_steps`` it stops after that
    step's evaluation, when one is due."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._install_trainer_hooks()
        install_samples_generator(self.samples_generator, StoppableSamplesGenerator)


# OpenRLHF's train() (cli/train_ppo_ray.py) creates it through the name PPOTrainer, which
# launch.run_openrlhf's "driver" site of upstream.TABLE points at.
GroupAwarePPOTrainer = ray.remote(_GroupAwarePPOTrainer)
